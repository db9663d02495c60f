"""The PyTorch code fragments of the seed documents (../shared/seeds/*.txt: how users
write Horovod PyTorch scripts), each kept verbatim in a file of tests/seed_fragments/
with a minimal harness around it, run on 2 workers under ``python -m
horovod_torch.runner`` (horovodrun) with offline data.

Seed 000's complete ``train.py`` is ``examples/elastic/train.py``, run elastically (one
worker killed, a host added) by
tests/test_elastic.py::test_oci_train_script_survives_a_kill_and_a_new_host; here we
only check that the example is still the seed's script. Seeds 001, 002 and 004 hold
TensorFlow/Keras code only (checked below).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FRAGMENTS = REPO / "tests" / "seed_fragments"
sys.path.insert(0, str(FRAGMENTS))
from seed_blocks import SEEDS, SHARED_SEEDS, blocks, fragment_code  # noqa: E402

PY = sys.executable
NP = 2
TIMEOUT = 240  # every subprocess
HEADER = re.compile(r"^# Seed fragment: \.\./shared/seeds/(\S+), lines (\d+)-(\d+)$", re.M)

# (fragment file, extra arguments, id printed in "FRAGMENT OK <id>")
CPU_RUNS = [
    ("seed000_1_init.py", [], "000.1"),
    ("seed000_2_pin_gpu.py", ["--no-cuda"], "000.2"),
    ("seed000_3_scale_lr.py", [], "000.3"),
    ("seed000_4_distributed_optimizer.py", [], "000.4"),
    ("seed000_4_distributed_optimizer.py", ["--use-adasum", "--fp16-allreduce"], "000.4"),
    ("seed003_1_init.py", [], "003.1"),
    ("seed003_3_scale_lr.py", [], "003.3"),
    ("seed003_4_distributed_optimizer.py", ["--fp16-allreduce"], "003.4"),
    ("seed003_5_broadcast.py", [], "003.5"),
    ("seed003_6_data_loading.py", [], "003.6"),
    ("seed003_6b_dataobject.py", [], "003.6b"),
    ("seed003_7_checkpoint.py", [], "003.7"),
    ("seed003_8_metric_average.py", [], "003.8"),
]
GPU_RUNS = [
    ("seed000_2_pin_gpu.py", ["--expect-cuda"], "000.2"),
    ("seed003_2_pin_gpu.py", [], "003.2"),
]
# Where each seed's PyTorch code is: a heading that opens it (None: the whole document).
# The other seeds must not contain PyTorch code.
PYTORCH_PART = {"000_52b4d2bf3dde7fdb.txt": "PyTorch", "003_96f08bc267ccd6d9.txt": None}
TRAIN_PY_SEED = "000_52b4d2bf3dde7fdb.txt"

needs_seeds = pytest.mark.skipif(not SEEDS.is_dir(), reason=f"no seed documents at {SEEDS}")


def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["NCCL_NVLS_ENABLE"] = "0"  # as tests/test_gpu.py
    return env


def _explain(proc: subprocess.CompletedProcess) -> str:
    return (f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
            f"--- stderr\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The fragments' working directory: MNIST-format files under datasets/ (where the
    ALCF fragment reads them, download=True finds them there), and out/."""
    root = tmp_path_factory.mktemp("fragments")
    proc = subprocess.run([PY, "-m", "horovod_torch.data", "mnist", str(root / "datasets"),
                           "--train-size", "2000", "--test-size", "400"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, _explain(proc)
    (root / "out").mkdir()
    return root


def _run_fragment(workdir: Path, script: str, args: List[str], frag_id: str) -> None:
    out_dir = workdir / "out" / "_".join([script[:-3], *(a.strip("-") for a in args)])
    out_dir.mkdir()
    cmd = [PY, "-m", "horovod_torch.runner", "-np", str(NP), PY, str(FRAGMENTS / script),
           *args, "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, _explain(proc)
    for rank in range(NP):
        line = f"[{rank}]<stdout>:FRAGMENT OK {frag_id} rank {rank} of {NP}"
        assert line in proc.stdout.splitlines(), _explain(proc)


@pytest.mark.parametrize("script,args,frag_id", CPU_RUNS,
                         ids=[" ".join([s[:-3], *a]) for s, a, _ in CPU_RUNS])
def test_fragment_runs_on_two_workers(workdir, script, args, frag_id):
    if script == "seed003_6_data_loading.py":
        pytest.importorskip("torchvision")
    _run_fragment(workdir, script, args, frag_id)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < NP, reason=f"needs {NP} CUDA GPUs")
@pytest.mark.parametrize("script,args,frag_id", GPU_RUNS, ids=[s[:-3] for s, _, _ in GPU_RUNS])
def test_gpu_fragment_runs_on_two_workers(workdir, script, args, frag_id):
    _run_fragment(workdir, script, args, frag_id)


def test_every_fragment_file_is_run():
    files = sorted(p.name for p in FRAGMENTS.glob("seed[0-9]*.py") if fragment_code(p) is not None)
    assert files == sorted({s for s, _, _ in CPU_RUNS + GPU_RUNS}), files


@needs_seeds
@pytest.mark.parametrize("path", sorted(FRAGMENTS.glob("seed[0-9]*.py")), ids=lambda p: p.stem)
def test_fragment_is_verbatim_from_its_seed(path):
    code = fragment_code(path)
    if code is None:
        pytest.skip("not a fragment file")
    m = HEADER.search(path.read_text())
    assert m, f"{path.name} does not say where its fragment comes from"
    seed, first, last = m.group(1), int(m.group(2)), int(m.group(3))
    by_line = {b.line: b for b in blocks(SEEDS / seed)}
    assert first in by_line, f"no code block starts at line {first} of {seed}"
    assert code == by_line[first].code, f"{path.name} differs from {seed}:{first}"
    assert last == first + len(code.splitlines()) - 1


def _pytorch_blocks(seed: Path):
    text_lines = seed.read_text().splitlines()
    marker = PYTORCH_PART[seed.name]
    start = 0 if marker is None else next(
        i + 1 for i, ln in enumerate(text_lines) if ln.strip() == marker)
    return [b for b in blocks(seed) if b.line > start and b.code.strip()
            and b.language in ("python", "")]


@needs_seeds
def test_every_pytorch_fragment_of_the_seeds_has_a_file():
    fragments = {fragment_code(p) for p in FRAGMENTS.glob("seed[0-9]*.py")} - {None}
    train_py = (REPO / "examples" / "elastic" / "train.py").read_text()
    missing = []
    for seed in sorted(SEEDS.glob("*.txt")):
        if seed.name not in PYTORCH_PART:
            torch_lines = [b.line for b in blocks(seed) if re.search(r"\btorch\b", b.code)]
            assert not torch_lines, f"{seed.name} has PyTorch code at lines {torch_lines}: " \
                "give it fragments and an entry in PYTORCH_PART"
            continue
        for b in _pytorch_blocks(seed):
            if b.code not in fragments and b.code not in train_py:
                missing.append(f"{seed.name}:{b.line}")
    assert not missing, f"PyTorch code blocks without a fragment file: {missing}"


@needs_seeds
def test_seed000_train_py_is_examples_elastic_train_py():
    """Run elastically by tests/test_elastic.py (not duplicated here)."""
    train_py = (REPO / "examples" / "elastic" / "train.py").read_text()
    scripts = [b for b in blocks(SEEDS / TRAIN_PY_SEED) if "@hvd.elastic.run" in b.code]
    assert len(scripts) == 1
    assert scripts[0].code in train_py
    # Everything else in the example is its header comment.
    head = train_py[:train_py.index(scripts[0].code)]
    assert all(ln.startswith("#") for ln in head.splitlines() if ln.strip()), head


@pytest.mark.skipif(not SHARED_SEEDS.is_dir(), reason=f"no {SHARED_SEEDS} on this machine")
def test_seed_copy_matches_the_shared_seeds():
    shared = {p.name: p.read_bytes() for p in SHARED_SEEDS.glob("*.txt")}
    copy = {p.name: p.read_bytes() for p in SEEDS.glob("*.txt")}
    assert copy == shared, "tests/seed_fragments/seeds is out of date with ../shared/seeds"
