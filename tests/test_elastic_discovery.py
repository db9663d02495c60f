"""A host discovery script that hangs must not stall an elastic job (issue #21).

The driver runs the script in the background, so it keeps noticing failed workers
while a run is outstanding; a run that times out, and one still going when the job
ends, is killed with its whole process group (nothing it started is left behind).
"""
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import List, Tuple

from tests.harness import ROOT

SCRIPT = os.path.join(ROOT, "tests", "elastic_train.py")
TIMEOUT = 240

# horovodrun with a shorter discovery timeout (DISCOVERY_TIMEOUT_S, 30 s by default).
SHORT_TIMEOUT_LAUNCHER = textwrap.dedent("""
    import os, sys
    from horovod_torch.runner import discovery, launch
    discovery.DISCOVERY_TIMEOUT_S = float(os.environ["TEST_DISCOVERY_TIMEOUT"])
    sys.exit(launch.main(sys.argv[1:]))
""")


def _hanging_discovery(tmp_path: Path, good_runs: int) -> Tuple[Path, str]:
    """A discovery script that lists localhost:2 for its first `good_runs` runs, then
    hangs in a `sleep` carrying a marker unique to this test; returns the script and
    the marker (find its processes with _marked())."""
    marker = f"1000.{os.getpid()}{random.randrange(10**6):06d}"
    script = tmp_path / "discover.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        n=$(cat {tmp_path}/runs 2>/dev/null || echo 0)
        echo $((n + 1)) > {tmp_path}/runs
        if [ "$n" -ge {good_runs} ]; then
            sleep {marker}
        fi
        echo localhost:2
        """))
    script.chmod(0o755)
    return script, marker


def _marked(marker: str) -> List[int]:
    """Processes whose command line carries the marker."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state not in ("Z", "X"):
            pids.append(int(pid))
    return pids


def _assert_none_left(marker: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _marked(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"discovery processes outlived the job: {left}"


def _env(tmp_path: Path, **extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               MARKER=str(tmp_path / "killed"), EDIT_FILE=str(tmp_path / "unused"))
    env.update(extra)
    return env


def test_hanging_discovery_does_not_delay_recovery(tmp_path):
    """The script hangs (for 1000 s) from its third run on; rank 1 is killed after
    that. The survivor must carry on within seconds, not once the driver's discovery
    call times out (up to 30 s later), and the hung script's `sleep` must not
    outlive the job."""
    script, marker = _hanging_discovery(tmp_path, good_runs=2)
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", "2", "--min-np", "1",
           "--max-np", "2", "--host-discovery-script", str(script), sys.executable, SCRIPT]
    try:
        out = subprocess.run(cmd, env=_env(tmp_path, KILL_RANK="1", KILL_STEP="30",
                                           STEPS="120", STEP_SLEEP="0.05"),
                             capture_output=True, text=True, timeout=TIMEOUT)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text
        assert int((tmp_path / "runs").read_text()) >= 3, "discovery never hung:\n" + text
        assert "exited with code 3" in text, text
        recovery = [float(s) for s in re.findall(r"RECOVERY rank=0 seconds=([\d.]+)", text)]
        assert recovery, text
        print(f"recovery after the kill, discovery hanging: {recovery[0]} s")
        assert recovery[0] < 10, text
        finals = [line for line in text.splitlines() if "FINAL" in line]
        assert finals and all("step=120" in f and "same=True" in f for f in finals), text
    finally:
        _assert_none_left(marker)


def test_discovery_timeout_kills_the_script_group(tmp_path):
    """With a 2 s discovery timeout, every run from the third on times out: each is
    killed with the `sleep` it started (at most one is ever running), the log says
    so once, and the job trains on with the last good host list."""
    script, marker = _hanging_discovery(tmp_path, good_runs=2)
    cmd = [sys.executable, "-c", SHORT_TIMEOUT_LAUNCHER, "-np", "2", "--min-np", "1",
           "--max-np", "2", "--host-discovery-script", str(script), sys.executable, SCRIPT]
    proc = subprocess.Popen(cmd, env=_env(tmp_path, TEST_DISCOVERY_TIMEOUT="2",
                                          STEPS="260", STEP_SLEEP="0.05"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: List[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    most = 0
    try:
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            most = max(most, len(_marked(marker)))
            time.sleep(0.1)
        assert proc.poll() is not None, "the job did not finish:\n" + "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        _assert_none_left(marker)
    text = "".join(lines)
    assert proc.returncode == 0, text
    runs = int((tmp_path / "runs").read_text())
    assert runs >= 5, f"only {runs} discovery runs (2 good, the rest hung):\n" + text
    assert most == 1, f"{most} hung discovery runs alive at once:\n" + text
    assert text.count("did not finish within 2 s") == 1, text
    assert "keeping the last host list (localhost:2)" in text, text
    finals = [line for line in text.splitlines() if "FINAL" in line]
    assert len(finals) == 2 and all("step=260" in f and "size=2" in f for f in finals), text


def test_a_failing_discovery_script_is_reported_once_with_the_wait(tmp_path):
    """A script that exits 3 and writes nothing: one line says so (not a bare "3: ",
    not twice) and how long the driver waits for hosts."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\nexit 3\n")
    script.chmod(0o755)
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", "1", "--min-np", "1",
           "--elastic-timeout", "3", "--host-discovery-script", str(script), "true"]
    out = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True,
                         timeout=TIMEOUT)
    lines = [line for line in out.stderr.splitlines() if "host discovery failed" in line]
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0] == ("horovodrun: host discovery failed: host discovery script exited "
                        "with 3 and wrote nothing on stderr; no host known yet: waiting up "
                        "to --elastic-timeout 3 s for --min-np 1 slots"), out.stderr
