"""Elastic jobs under the real horovodrun: failures, hosts added and removed."""
import os
import re
import subprocess
import sys

from tests.harness import ROOT

SCRIPT = os.path.join(ROOT, "tests", "elastic_train.py")


def _run(tmp_path, hosts_text, extra_env, args=(), timeout=240):
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(hosts_text.replace(";", "\n") + "\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=ROOT, MARKER=str(tmp_path / "killed"),
               EDIT_FILE=str(hosts_file), OMP_NUM_THREADS="1", **extra_env)
    cmd = [sys.executable, "-m", "horovod_torch.runner", "--host-discovery-script",
           str(discover), *args, sys.executable, SCRIPT]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def _finals(output):
    return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in output.splitlines()
            if "FINAL" in line]


def test_worker_failure_restores_and_continues(tmp_path):
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "15"},
                   ["-np", "2", "--min-np", "1", "--max-np", "2",
                    "--blacklist-cooldown-range", "1", "2"])
    assert rc == 0, out
    assert "exited with code 3" in out and "lost a peer" in out, out
    finals = _finals(out)
    assert finals and all(f["step"] == "40" and f["same"] == "True" for f in finals), out
    assert any(f["size"] == "2" for f in finals), "the replacement worker did not join:\n" + out


def test_host_added_joins_running_job(tmp_path):
    rc, out = _run(tmp_path, "localhost:1",
                   {"EDIT_STEP": "5", "EDIT_TEXT": "localhost:1;127.0.0.2:1", "STEPS": "60",
                    "STEP_SLEEP": "0.05"},
                   ["-np", "1", "--min-np", "1", "--max-np", "2"])
    assert rc == 0, out
    finals = _finals(out)
    assert len(finals) == 2 and all(f["size"] == "2" and f["same"] == "True" for f in finals), out
    assert "generation 1: 2 workers" in out, out


def test_host_removed_job_continues_without_sync(tmp_path):
    rc, out = _run(tmp_path, "localhost:1;127.0.0.2:1",
                   {"EDIT_STEP": "5", "EDIT_TEXT": "localhost:1", "STEPS": "40",
                    "STEP_SLEEP": "0.05"},
                   ["-np", "2", "--min-np", "1", "--max-np", "2"])
    assert rc == 0, out
    finals = _finals(out)
    assert len(finals) == 1 and finals[0]["size"] == "1" and finals[0]["step"] == "40", out
    assert "not part of generation" in out, out


def test_reset_limit_stops_a_job_that_keeps_failing(tmp_path):
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "3",
                                             "KILL_ALWAYS": "1"},
                   ["-np", "2", "--min-np", "1", "--max-np", "2", "--reset-limit", "1",
                    "--blacklist-cooldown-range", "0.1", "0.3"], timeout=120)
    assert rc == 1, out
    assert "more than --reset-limit 1" in out, out


def test_too_few_workers_for_min_np_ends_with_clear_error(tmp_path):
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "3"},
                   ["-np", "2", "--min-np", "2", "--max-np", "2", "--elastic-timeout", "3"],
                   timeout=120)
    assert rc == 1, out
    assert "fewer than --min-np 2" in out, out
