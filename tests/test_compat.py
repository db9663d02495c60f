"""Runs the Horovod compatibility suite (tests/compat) the way a Horovod user runs their
own tests: every rank runs pytest under the launcher,

    horovodrun -np 2 python -m pytest tests/compat -q -p no:cacheprovider

(``python -m horovod_torch.runner`` is horovodrun), and checks that each rank's pytest
reported every collected test as passed, the known incompatibilities as xfailed, and
nothing failed."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
NP = 2
TIMEOUT = 600  # the suite takes well under a minute; this only bounds a hang
SUMMARY = re.compile(r"^\[(\d+)\]<stdout>:(?:=+ )?((?:\d+ \w+(?:, )?)+) in [\d.]+s", re.M)


def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _collect(*extra: str) -> List[str]:
    """Node ids pytest collects from tests/compat (HOROVOD_RANK set, as under the
    launcher, so tests/conftest.py collects the suite; collecting starts no job)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/compat", "--collect-only",
                           "-q", "-p", "no:cacheprovider", *extra], cwd=REPO,
                          env=dict(_env(), HOROVOD_RANK="0"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing selected
    return [line for line in proc.stdout.splitlines() if "::" in line]


def _counts(summary: str) -> Dict[str, int]:
    """'81 passed, 7 xfailed' -> {'passed': 81, 'xfailed': 7}."""
    return {word: int(num) for num, word in re.findall(r"(\d+) (\w+)", summary)}


def test_compat_suite_passes_on_every_rank_under_horovodrun():
    collected = _collect()
    expected_xfail = _collect("-m", "xfail")
    assert len(collected) > 50, collected
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", str(NP),
           sys.executable, "-m", "pytest", "tests/compat", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    explain = f"rc={proc.returncode}\n{out[-12000:]}"
    assert proc.returncode == 0, explain
    summaries = {int(rank): _counts(text) for rank, text in SUMMARY.findall(proc.stdout)}
    assert sorted(summaries) == list(range(NP)), explain
    want = {"passed": len(collected) - len(expected_xfail)}
    if expected_xfail:
        want["xfailed"] = len(expected_xfail)
    for rank, counts in summaries.items():
        counts.pop("warning", None)
        counts.pop("warnings", None)
        assert counts == want, f"rank {rank}: {counts} != {want}\n{explain}"
