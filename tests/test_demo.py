"""examples/elastic/demo.py end to end: the OCI elastic MNIST script on 2 local workers
under horovodrun; in fault mode the demo kills rank 1, the job goes on with 1 worker
and a new worker joins after the blacklist cooldown. Small data and a 1 s cooldown;
enough epochs (20) that the survivor, which trains on alone while the new worker
starts, is still training when that worker reaches hvd.init() and joins (with 8, a
fast host's survivor finished in 5 s, before the new worker got there)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

pytest.importorskip("torchvision")

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TIMEOUT = 300  # every demo run


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    for var in ("HOROVOD_ELASTIC", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_START_TIMEOUT",
                "HOROVOD_LOG_LEVEL"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _demo(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    """Runs the demo in a session of its own: on a timeout the whole session (the demo
    and horovodrun, whose reaper then stops the workers) is stopped."""
    cmd = [PY, "examples/elastic/demo.py", "--sync-dir", str(tmp / "sync"), "--timeout",
           str(TIMEOUT - 30), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"the demo did not finish within {TIMEOUT} s:\n{out[-6000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _explain(proc: subprocess.CompletedProcess) -> str:
    return (f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-8000:]}\n"
            f"--- stderr\n{proc.stderr[-3000:]}")


def _summary(out: str) -> Dict[str, str]:
    """{"generations": "gen 0: 2 workers, ...", "killed": ..., ...} from the summary."""
    block = out[out.index("demo: summary"):]
    return dict(re.findall(r"^demo:   ([a-z ]+):\s+(.*)$", block, re.M))


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("mnist"))
    proc = subprocess.run([PY, "-m", "horovod_torch.data", "mnist", root, "--train-size",
                           "6000", "--test-size", "500"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, _explain(proc)
    return root


def test_demo_kills_a_worker_and_a_new_one_joins(mnist_dir, tmp_path):
    # 3000 images a worker: 47 steps an epoch; the kill after batch 10.
    proc = _demo("--data-dir", mnist_dir, "--epochs", "20", "--cooldown", "1", "1",
                 "--kill-after", "3", "--", "--log-interval", "5", tmp=tmp_path)
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    # The kill, announced in one line, of rank 1 (not rank 0), after batch 10 of epoch 1.
    kills = re.findall(r"^demo: killing worker rank (\d+) \(pid (\d+)\) at [\d.]+ s \(SIGKILL\), "
                       r"after rank 0 logged epoch 1 \[640/3000\]", out, re.M)
    assert kills and kills[0][0] == "1", _explain(proc)
    assert "Process 1 exit with status code 137." in out, _explain(proc)
    s = _summary(out)
    assert s["generations"] == "gen 0: 2 workers, gen 1: 1 worker, gen 2: 2 workers", _explain(proc)
    assert s["killed"].startswith(f"rank 1 (pid {kills[0][1]}) at "), _explain(proc)
    m = re.match(r"gen 1 \(1 worker\) formed [\d.]+ s after the kill; next completed step "
                 r"([\d.]+) s after the kill \(epoch 1, rank 0\)$", s["survived"])
    assert m, _explain(proc)
    # The commit the survivor restored, as it said: commit n saves batch n-1 of epoch 1
    # (one a batch); the kill comes right after rank 0's line for batch 10.
    m = re.match(r"commit (\d+) \(epoch=1, batch=(\d+)\), the survivor's last commit before "
                 r"the kill$", s["restored from"])
    assert m, _explain(proc)
    restored, batch = int(m.group(1)), int(m.group(2))
    assert restored == batch + 1 and 10 <= batch < 47, _explain(proc)
    said = f"; restoring commit {restored} (epoch=1, batch={batch}) and re-forming the job"
    assert said in out + proc.stderr, _explain(proc)
    m = re.match(r"gen 2 \(2 workers\) formed ([\d.]+) s after the kill; first step with the "
                 r"new worker ([\d.]+) s after the kill, (\d+) progress lines from then on$",
                 s["rejoined"])
    assert m and float(m.group(2)) >= float(m.group(1)) and int(m.group(3)) >= 2, _explain(proc)
    # The new worker trained: the killed one logged batches 0, 5 and 10 at most.
    assert len(re.findall(r"^\[1\]<stdout>:Train Epoch: ", out, re.M)) >= 6, _explain(proc)
    acc = re.fullmatch(r"([\d.]+)%", s["test accuracy"])
    assert acc and 0 < float(acc.group(1)) <= 100, _explain(proc)
    assert re.match(r"[\d.]+ s \(job exit code 0\)$", s["wall time"]), _explain(proc)
    assert "demo: kept: a worker was killed" in out, _explain(proc)


def test_demo_no_fault(mnist_dir, tmp_path):
    proc = _demo("--no-fault", "--data-dir", mnist_dir, "--epochs", "1", "--",
                 "--log-interval", "20", tmp=tmp_path)
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    assert "demo: killing" not in out and "exit with status code" not in out, _explain(proc)
    s = _summary(out)
    assert s["generations"] == "gen 0: 2 workers", _explain(proc)
    assert "killed" not in s, _explain(proc)
    assert re.fullmatch(r"[\d.]+%", s["test accuracy"]), _explain(proc)
    assert "demo: kept: training finished" in out, _explain(proc)


def test_an_unbuilt_checkout_is_not_put_before_an_installed_package(tmp_path):
    # demo.py puts its checkout first on PYTHONPATH only when its extension is built
    # there; an unbuilt checkout would hide a pip-installed horovod_torch (#36).
    import importlib.util
    spec = importlib.util.spec_from_file_location("hvd_demo", REPO / "examples/elastic/demo.py")
    demo = importlib.util.module_from_spec(spec)
    sys.modules["hvd_demo"] = demo  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(demo)
    finally:
        del sys.modules["hvd_demo"]
    (tmp_path / "horovod_torch").mkdir()
    assert demo.python_path({"PYTHONPATH": "/x"}, str(tmp_path)) == "/x"
    assert demo.python_path({}, str(tmp_path)) == ""
    (tmp_path / "horovod_torch" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert demo.python_path({"PYTHONPATH": "/x"}, str(tmp_path)) == f"{tmp_path}{os.pathsep}/x"
