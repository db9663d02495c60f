"""End-to-end runs of the user-facing examples and the CPU benchmarks, each on
2 local workers under ``python -m horovod_torch.runner`` (CPU, tiny sizes)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

pytest.importorskip("torchvision")

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TIMEOUT = 240  # every subprocess


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    for var in ("HOROVOD_ELASTIC", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_START_TIMEOUT",
                "HOROVOD_LOG_LEVEL"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: List[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc


def _launch(np: int, *worker_cmd: str) -> subprocess.CompletedProcess:
    return _run([PY, "-m", "horovod_torch.runner", "-np", str(np), PY, *worker_cmd])


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("mnist"))
    proc = _run([PY, "-m", "horovod_torch.data", "mnist", root,
                 "--train-size", "2000", "--test-size", "400"], timeout=120)
    assert proc.returncode == 0, _explain(proc)
    return root


def test_pytorch_mnist_two_workers(mnist_dir):
    proc = _launch(2, "examples/pytorch_mnist.py", "--epochs", "1", "--data-dir", mnist_dir,
                   "--batch-size", "8", "--lr", "0.03", "--test-batch-size", "200",
                   "--log-interval", "50")
    assert proc.returncode == 0, _explain(proc)
    # The data written by the fixture (2000/400) is used as it is, not rewritten.
    assert re.search(r"^\[0\]<stdout>:Data: .*sklearn digits.*\(2000/400 train/test images",
                     proc.stdout, re.M), _explain(proc)
    acc = re.findall(r"^\[(\d+)\]<stdout>:Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%",
                     proc.stdout, re.M)
    assert [r for r, _ in acc] == ["0"], _explain(proc)  # printed once, by rank 0
    assert float(acc[0][1]) > 50.0, _explain(proc)
    # Both workers trained on their half of the data.
    for rank in ("0", "1"):
        assert re.search(rf"^\[{rank}\]<stdout>:Train Epoch: 1 \[0/1000 ", proc.stdout, re.M), \
            _explain(proc)


def test_synthetic_benchmark_cpu():
    proc = _launch(2, "examples/pytorch_synthetic_benchmark.py", "--model", "resnet18",
                   "--batch-size", "2", "--image-size", "64", "--num-warmup-batches", "1",
                   "--num-batches-per-iter", "2", "--num-iters", "2", "--no-cuda")
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    assert "[0]<stdout>:Model: resnet18" in out, _explain(proc)
    assert "[0]<stdout>:Number of CPUs: 2" in out, _explain(proc)
    assert len(re.findall(r"^\[0\]<stdout>:Iter #\d+: [\d.]+ img/sec per CPU", out, re.M)) == 2
    m = re.search(r"^\[0\]<stdout>:Img/sec per CPU: ([\d.]+) \+-([\d.]+)$", out, re.M)
    assert m and float(m.group(1)) > 0, _explain(proc)
    m = re.search(r"^\[0\]<stdout>:Total img/sec on 2 CPU\(s\): ([\d.]+) \+-([\d.]+)$", out, re.M)
    assert m and float(m.group(1)) > 0, _explain(proc)
    assert "[1]<stdout>:Model" not in out  # only rank 0 logs


def test_train_cpu_bench():
    proc = _run([PY, "bench/train_cpu.py", "--np", "2", "--steps", "4", "--block", "2",
                 "--warmup", "1", "--batch-size", "8", "--model", "mlp"])
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    for lib in ("hvd", "DDP"):
        assert re.search(rf"^\s+{lib}\s+[\d.]+\s+[\d.]+", out, re.M), _explain(proc)
    m = re.search(r"^ratio hvd/DDP \(steps/s\): ([\d.]+)$", out, re.M)
    assert m and float(m.group(1)) > 0, _explain(proc)
    m = re.search(r"^parameters identical across ranks: hvd yes, DDP yes; "
                  r"hvd vs DDP max \|diff\| = (\S+)", out, re.M)
    assert m, _explain(proc)
    # Same model, data and SGD; with 2 ranks the averages are exact in both libraries.
    assert float(m.group(1)) < 1e-5, _explain(proc)


def test_scale_bench(tmp_path):
    out = tmp_path / "scale.json"
    proc = _run([PY, "bench/scale.py", "--np", "2", "--sizes", "4K", "--iters", "2",
                 "--timeout", "200", "--json", str(out)])
    assert proc.returncode == 0, _explain(proc)
    # The summary row: ranks | hvd init | gloo init | hvd ms | gloo ms | ratio | fds | threads
    row = r"^\| 2 \| " + r"[\d.]+ \| " * 4 + r"[\d.]+x \| \d+ \| \d+ \|$"
    assert re.search(row, proc.stdout, re.M), _explain(proc)
    (result,) = json.loads(out.read_text())["results"]
    assert result["ranks"] == 2 and result["sizes"][0]["bytes"] == 4096, result
    assert result["fds_after_hvd"] >= result["fds_base"] > 0, result


def test_profile_gpu_reads_a_kernel_trace(tmp_path):
    """bench/profile_gpu.py's reading of a CUDA-only trace (it runs on GPUs only): kernels
    overlapping on two streams count once, NCCL's apart, the idle gaps between."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import profile_gpu
    finally:
        sys.path.remove(str(REPO / "bench"))
    def k(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    # Two steps over 0-400 us: compute 0-100 and 150-250 (two overlapping kernels) and
    # 300-400; NCCL 80-120 (20 us of it alone) and 250-260 (alone); a CPU op ignored.
    events = [k("conv", 0, 100), k("gemm", 150, 60), k("bn", 200, 50, "gpu_memcpy"),
              k("ncclDevKernel_AllReduce", 80, 40), k("ncclDevKernel_AllReduce", 250, 10),
              k("relu", 300, 100), k("aten::add", 0, 1000, "cpu_op")]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = profile_gpu.summarize(str(path), 2)
    want = {"gpu compute": 0.15, "gpu nccl": 0.025, "nccl exposed": 0.015,
            "gpu idle": 0.035, "nccl kernels": 1.0, "kernels": 2.0}
    assert got == pytest.approx(want), got
    path.write_text(json.dumps({"traceEvents": [k("aten::add", 0, 5, "cpu_op")]}))
    assert profile_gpu.summarize(str(path), 2) == {}


def test_synthetic_benchmark_use_adasum():
    """--use-adasum trains with op=hvd.Adasum over TCP."""
    proc = _launch(2, "examples/pytorch_synthetic_benchmark.py", "--model", "resnet18",
                   "--batch-size", "2", "--image-size", "32", "--num-warmup-batches", "1",
                   "--num-batches-per-iter", "1", "--num-iters", "1", "--no-cuda",
                   "--use-adasum")
    assert proc.returncode == 0, _explain(proc)
    assert "Total img/sec on 2 CPU(s)" in proc.stdout, _explain(proc)


def test_readme_snippet_runs_as_written(tmp_path):
    """The README's "Using it" Python block, copied as it is, trains on 2 workers."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Using it"):]
    snippet = section[section.index("```python\n") + len("```python\n"):]
    snippet = snippet[:snippet.index("```")]
    script = tmp_path / "train.py"
    script.write_text(snippet)
    proc = _launch(2, str(script))
    assert proc.returncode == 0, _explain(proc)
    assert re.search(r"trained on 2 ranks, last loss \d+\.\d+", proc.stdout), _explain(proc)


def test_ddp_survivors_rebuild_the_group_after_a_worker_dies():
    proc = _run([PY, "examples/torch_distributed/ddp_survivors.py", "--np", "3",
                 "--fail-rank", "2", "--fail-step", "5", "--steps", "12"], timeout=180)
    assert proc.returncode == 0, _explain(proc)
    for rank in (0, 1):
        assert f"rank {rank}: rebuilt a group of 2 at step 5" in proc.stdout, _explain(proc)
        assert (f"rank {rank}: finished 12 steps on 2 ranks; parameters equal to rank 0's: "
                "True") in proc.stdout, _explain(proc)
