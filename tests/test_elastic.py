"""Elastic jobs under the real horovodrun: failures, hosts added and removed."""
import os
import re
import subprocess
import sys
import time

import pytest

from tests.harness import ROOT

SCRIPT = os.path.join(ROOT, "tests", "elastic_train.py")
# Two workers on one host that may drop to one and come back (its host is blacklisted
# for 1-2 s after a failure).
TWO_ONE_HOST = ["-np", "2", "--min-np", "1", "--max-np", "2",
                "--blacklist-cooldown-range", "1", "2"]


def _run(tmp_path, hosts_text, extra_env, args=(), timeout=240, script=SCRIPT, before=""):
    """horovodrun with a discovery script printing tmp_path/hosts.txt (after the shell
    lines `before`)."""
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(hosts_text.replace(";", "\n") + "\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\n{before}cat {hosts_file}\n")
    discover.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": ROOT, "MARKER": str(tmp_path / "killed"),
           "EDIT_FILE": str(hosts_file), "OMP_NUM_THREADS": "1", **extra_env}
    cmd = [sys.executable, "-m", "horovod_torch.runner", "--host-discovery-script",
           str(discover), *args, sys.executable, script]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def _finals(output):
    return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in output.splitlines()
            if "FINAL" in line]


def _assert_trained_on(out, steps, size, what):
    """Every worker finished all `steps` with the same state, some in a world of `size`
    again (the replacement joined), and rank 0 said how long recovery took (returned,
    and printed with `what`)."""
    finals = _finals(out)
    assert finals and all(f["step"] == str(steps) and f["same"] == "True" for f in finals), out
    assert any(f["size"] == str(size) for f in finals), \
        "the replacement worker did not join:\n" + out
    recovery = re.findall(r"RECOVERY rank=0 seconds=([\d.]+)", out)
    assert recovery, out
    print(f"recovery from {what} to the next completed step: {recovery[0]} s")
    return float(recovery[0])


def test_worker_failure_restores_and_continues(tmp_path):
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "15",
                                             "STEPS": "60", "STEP_SLEEP": "0.05",
                                             "WAIT_STEP": "20", "WAIT_SIZE": "2"},
                   TWO_ONE_HOST)
    assert rc == 0, out
    assert "exited with code 3" in out and "lost a peer" in out, out
    # The survivor says which commit it goes back to, with the state's counters.
    assert re.search(r"lost a peer \(.*\); restoring commit \d+ \(.*step=\d+", out), out
    _assert_trained_on(out, 60, 2, "a worker's death")


def test_stopped_worker_is_killed_and_the_job_goes_on(tmp_path):
    """A worker stopped with SIGSTOP never exits: the survivor fails after
    HOROVOD_TCP_TIMEOUT and reports it, and the driver kills the silent worker, re-forms
    the job without it, and grows back (before: the survivor waited for a generation
    that never came until HOROVOD_ELASTIC_TIMEOUT)."""
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "15",
                                             "KILL_HOW": "stop", "HOROVOD_TCP_TIMEOUT": "3",
                                             "STEPS": "60", "STEP_SLEEP": "0.05",
                                             "WAIT_STEP": "20", "WAIT_SIZE": "2",
                                             "HOROVOD_ELASTIC_TIMEOUT": "100"},
                   TWO_ONE_HOST, timeout=150)
    assert rc == 0, out
    assert "stopped or hung; killing it" in out and "lost a peer" in out, out
    _assert_trained_on(out, 60, 2, "a worker's SIGSTOP")


def test_replacement_takes_the_dead_workers_local_rank(tmp_path):
    """Rank 0 of a host's two dies. Its replacement gets local rank 0, the one freed,
    and the survivor keeps local rank 1: a script that picks its GPU once with
    torch.cuda.set_device(hvd.local_rank()) keeps one process per GPU (before: the
    replacement got local rank 1, the survivor's GPU, and NCCL refuses two ranks on
    one GPU)."""
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "0", "KILL_STEP": "10",
                                             "STEPS": "40", "STEP_SLEEP": "0.05",
                                             "WAIT_STEP": "15", "WAIT_SIZE": "2"},
                   TWO_ONE_HOST)
    assert rc == 0, out
    finals = _finals(out)
    assert len(finals) == 2 and all(f["size"] == "2" for f in finals), out
    assert sorted(f["device"] for f in finals) == ["0", "1"], out
    assert all(f["local_rank"] == f["device"] for f in finals), out


def test_a_replacement_that_dies_inside_init_does_not_stall_the_survivor(tmp_path):
    """Rank 1 dies; its replacement dies inside hvd.init() once assigned a generation.
    The driver tells that generation's rendezvous (elastic/<gen>/init_error), the
    survivor leaves it at once and goes on, and a second replacement joins (before: the
    survivor waited in the rendezvous until HOROVOD_START_TIMEOUT, here 100 s, longer
    than this test's limit)."""
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "15",
                                             "DIE_IN_INIT": "1", "STEPS": "60",
                                             "STEP_SLEEP": "0.05", "WAIT_STEP": "20",
                                             "WAIT_SIZE": "2", "HOROVOD_START_TIMEOUT": "100"},
                   TWO_ONE_HOST, timeout=90)
    assert rc == 0, out
    assert os.path.exists(tmp_path / "killed.init"), out
    assert "exited with code 5" in out and "before reaching the rendezvous" in out, out
    _assert_trained_on(out, 60, 2, "a replacement's death inside init")


def test_without_max_np_the_job_grows_to_every_slot_found(tmp_path):
    """-np 1 and discovery printing localhost:2, no --max-np: the job grows to 2
    workers, as Horovod's (before: --max-np defaulted to -np, so it never grew)."""
    rc, out = _run(tmp_path, "localhost:2", {"STEPS": "30", "STEP_SLEEP": "0.05",
                                             "WAIT_STEP": "5", "WAIT_SIZE": "2"},
                   ["-np", "1", "--min-np", "1"])
    assert rc == 0, out
    finals = _finals(out)
    assert len(finals) == 2 and all(f["size"] == "2" and f["same"] == "True"
                                    for f in finals), out


def test_survivor_trains_on_until_the_replacement_reaches_init(tmp_path):
    """The generation that adds a worker is formed once that worker has reached
    hvd.init(): the survivor does not stop to wait while the newcomer starts. (From step
    550 on it does wait, so that the job cannot end before the newcomer joins however
    slowly it starts.)"""
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "15",
                                             "STEPS": "600", "STEP_SLEEP": "0.02",
                                             "LATE_INIT_S": "4", "WAIT_STEP": "550",
                                             "WAIT_SIZE": "2"},
                   TWO_ONE_HOST)
    assert rc == 0, out
    ready = float(re.search(r"LATE_READY at=([\d.]+)", out).group(1))
    grown = [(int(s), float(t)) for s, t in re.findall(r"RESET size=2 step=(\d+) at=([\d.]+)",
                                                        out)]
    assert grown, "the replacement worker did not join:\n" + out
    # The survivor trained on alone (4 s of the newcomer's start are about 150 steps),
    # and the world grew once the newcomer had reached hvd.init().
    assert min(s for s, _ in grown) >= 60 and min(t for _, t in grown) >= ready, out


def test_a_blink_of_host_discovery_changes_nothing(tmp_path):
    """The discovery script prints no host for about 3 s, then the host again, with
    --min-np 1: the workers train on, nothing resets (before: both were removed, a
    fresh worker formed a generation alone, and the job stopped with
    CommittedStateLostError)."""
    blink = tmp_path / "blink"
    before = (f'if [ -f {blink} ] && [ $(( $(date +%s) - $(stat -c %Y {blink}) )) -lt 3 ]; '
              'then exit 0; fi\n')
    rc, out = _run(tmp_path, "localhost:2", {"EDIT_STEP": "10", "EDIT_FILE": str(blink),
                                             "EDIT_TEXT": "now", "STEPS": "120",
                                             "STEP_SLEEP": "0.05"},
                   ["-np", "2", "--min-np", "1", "--max-np", "2"], before=before)
    assert rc == 0, out
    assert "no longer lists localhost" in out and "listed again" in out, out
    finals = _finals(out)
    assert len(finals) == 2 and all(f["step"] == "120" and f["size"] == "2" and
                                    f["same"] == "True" and f["resets"] == "[]"
                                    for f in finals), out


@pytest.mark.parametrize("slots", [1, 2])
def test_host_added_joins_running_job_in_one_reset(tmp_path, slots):
    """A host added with one or two slots joins the running job in one generation, as
    in Horovod (#33 item 6; before, two slots gave one generation, so one reset and
    one sync, per arriving worker)."""
    size = 1 + slots
    rc, out = _run(tmp_path, "localhost:1",
                   {"EDIT_STEP": "5", "EDIT_TEXT": f"localhost:1;127.0.0.2:{slots}",
                    "STEPS": "60", "STEP_SLEEP": "0.05", "WAIT_SIZE": str(size)},
                   ["-np", "1", "--min-np", "1", "--max-np", str(size)])
    assert rc == 0, out
    finals = _finals(out)
    assert len(finals) == size and all(f["size"] == str(size) and f["same"] == "True"
                                       for f in finals), out
    first = [f for f in finals if f["rank"] == "0"]
    assert first and first[0]["resets"] == f"[{size}]", out
    assert f"generation 1: {size} workers" in out and "generation 2" not in out, out


def test_host_removed_job_continues_without_sync(tmp_path):
    rc, out = _run(tmp_path, "localhost:1;127.0.0.2:1",
                   {"EDIT_STEP": "5", "EDIT_TEXT": "localhost:1", "STEPS": "40",
                    "STEP_SLEEP": "0.05", "WAIT_SIZE": "1"},
                   ["-np", "2", "--min-np", "1", "--max-np", "2"])
    assert rc == 0, out
    finals = _finals(out)
    assert len(finals) == 1 and finals[0]["size"] == "1" and finals[0]["step"] == "40", out
    assert "not part of generation" in out, out


def test_a_worker_failing_after_the_training_fails_the_job(tmp_path):
    """Once a worker has finished, nothing re-forms: a worker that fails then (its
    save failed) fails the job with its status (before, the job exited 0)."""
    rc, out = _run(tmp_path, "localhost:2", {"FAIL_AFTER_RANK": "1", "STEPS": "10"},
                   ["-np", "2", "--min-np", "1", "--max-np", "2"], timeout=120)
    assert rc == 4, out
    assert "exited with code 4 after worker" in out and "Exit code: 4" in out, out


@pytest.mark.parametrize("late", ["waits", "fails", "slow"])
def test_workers_finishing_the_training_are_not_cut_short_by_a_new_host(tmp_path, late):
    """A host added after the last commit forms a generation the training's workers
    never join. Once one of them finishes, the new worker waiting for that generation
    is stopped, but the others finish first (before, they were killed with it, say
    in the middle of saving the model). If that new worker fails meanwhile (its
    rendezvous timed out), the job does not: it never trained. Nor is it waited for
    when it has not reached the rendezvous yet (a slow start): only workers of a
    generation that formed are, up to --elastic-timeout (600 s by default)."""
    env = {"AFTER_TEXT": "localhost:2;127.0.0.2:1", "STEPS": "10",
           "LATE_FAILS": str(int(late == "fails")), "LATE_SLOW_S": "300" if late == "slow" else ""}
    rc, out = _run(tmp_path, "localhost:2", env, ["-np", "2", "--min-np", "1", "--max-np", "3"],
                   timeout=180)  # (a wait for the slow worker would take 600 s)
    assert rc == 0, out
    assert "generation 1: 3 workers" in out, out
    if late == "fails":
        assert "exited with code 3" in out and "the job fails" not in out, out
    else:
        assert "finished the training before generation 1 formed" in out, out
    assert "SAVED rank=0" in out and "SAVED rank=1" in out, out


@pytest.mark.parametrize("hangs", [False, True])
def test_a_host_removed_after_the_training_lets_its_workers_finish(tmp_path, hangs):
    """A host leaves discovery after the last commit: the generation without it never
    forms, and its worker, which trained to the end with the others, may still be
    saving when they finish. It is waited for as they are (before, it was killed as
    soon as the others ended), up to --elastic-timeout after the first finished (here
    a save of 60 s is cut after 5 s)."""
    save_s, args = ("60", ["--elastic-timeout", "5"]) if hangs else ("4", [])
    t0 = time.monotonic()
    rc, out = _run(tmp_path, "localhost:1;127.0.0.2:1",
                   {"REMOVE_TEXT": "localhost:1", "STEPS": "10", "SAVE_S": save_s},
                   ["-np", "2", "--min-np", "1", "--max-np", "2", *args], timeout=120)
    assert rc == 0, out
    assert "generation 1: 1 workers" in out and "SAVED rank=0" in out, out
    if hangs:
        assert "SAVED rank=1" not in out and "(--elastic-timeout) after the first" in out, out
        assert time.monotonic() - t0 < 45, out
    else:
        assert "SAVED rank=1" in out, out


def test_a_removed_host_that_commits_rarely_leaves_at_its_commit_not_killed(tmp_path):
    """A removed worker trains on until its next commit, where every worker learns of
    the generation without it, however long that takes: the grace before it is killed
    counts from when the others have joined that generation (before, from the removal:
    a worker committing less often was killed mid-step, and the survivor went back to
    its last commit). The grace is made 1.5 s here; the workers commit every 4 s."""
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("localhost:1\n127.0.0.2:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": ROOT, "MARKER": str(tmp_path / "killed"),
           "EDIT_FILE": str(hosts_file), "OMP_NUM_THREADS": "1", "EDIT_STEP": "1",
           "EDIT_TEXT": "localhost:1", "STEPS": "5", "STEP_SLEEP": "4"}
    launcher = ("import sys; from horovod_torch.runner import elastic_removal; "
                "elastic_removal.REMOVED_GRACE_S = 1.5; "
                "from horovod_torch.runner.launch import main; sys.exit(main())")
    cmd = [sys.executable, "-c", launcher, "--host-discovery-script", str(discover),
           "-np", "2", "--min-np", "1", "--max-np", "2", sys.executable, SCRIPT]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    rc, out = out.returncode, out.stdout + out.stderr
    assert rc == 0, out
    assert "not part of generation 1" in out and "lost a peer" not in out, out
    finals = _finals(out)
    assert len(finals) == 1 and finals[0]["size"] == "1" and finals[0]["step"] == "5", out


def test_reset_limit_stops_a_job_that_keeps_failing(tmp_path):
    # Enough steps that the replacement worker joins before rank 0 could finish alone.
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "3",
                                             "KILL_ALWAYS": "1", "STEPS": "400",
                                             "STEP_SLEEP": "0.05"},
                   ["-np", "2", "--min-np", "1", "--max-np", "2", "--reset-limit", "1",
                    "--blacklist-cooldown-range", "0.1", "0.3"], timeout=120)
    assert rc == 1, out
    assert "exceeded limit: 1" in out, out


@pytest.mark.parametrize("limit", [2, 3])
def test_reset_limit_counts_every_re_formed_job(tmp_path, limit):
    """As Horovod counts: every generation after the first is a reset, whatever made
    it. A host joins (one reset), its worker dies (two), a replacement joins after the
    cool-down (three): --reset-limit 2 stops the job, 3 lets it finish (#33 item 6;
    before, only failures counted, so 2 let it finish too)."""
    rc, out = _run(tmp_path, "localhost:1",
                   {"EDIT_STEP": "5", "EDIT_TEXT": "localhost:1;127.0.0.2:1", "KILL_RANK": "1",
                    "KILL_STEP": "10", "STEPS": "40", "STEP_SLEEP": "0.05", "WAIT_STEP": "5",
                    "WAIT_SIZE": "2"},
                   ["-np", "1", "--min-np", "1", "--max-np", "2", "--reset-limit", str(limit),
                    "--blacklist-cooldown-range", "1", "2"])
    assert "exited with code 3" in out, out
    if limit == 2:
        assert rc == 1, out
        assert "exceeded limit: 2" in out and "generation 3" not in out, out
    else:
        assert rc == 0, out
        assert "generation 3: 2 workers" in out, out
        finals = _finals(out)
        assert len(finals) == 2 and all(f["step"] == "40" for f in finals), out


def test_a_failed_workers_host_leaves_with_its_other_workers(tmp_path):
    """As in Horovod, a worker's failure blacklists its host, and the host's other
    workers leave with it while --min-np workers remain elsewhere (#33 item 6; before,
    they stayed, and the job went on with 3 workers)."""
    rc, out = _run(tmp_path, "localhost:2;127.0.0.2:2",
                   {"KILL_RANK": "3", "KILL_STEP": "10", "STEPS": "30",
                    "STEP_SLEEP": "0.05"},
                   ["-np", "4", "--min-np", "2", "--max-np", "4"])
    assert rc == 0, out
    assert "generation 1: 2 workers on localhost:2" in out, out
    finals = _finals(out)
    assert len(finals) == 2 and all(f["size"] == "2" and f["step"] == "30" for f in finals), out


def test_blacklist_cooldown_follows_horovods_schedule():
    """n-th blacklisting: LO * 2**n + a random 0..LO seconds, within LO..HI (#33 item 6;
    before: a random LO..HI, doubled per further failure)."""
    from horovod_torch.runner.discovery import cooldown_s
    assert [cooldown_s(1, 100, n, 0.0) for n in (1, 2, 3)] == [2, 4, 8]
    assert cooldown_s(1, 100, 3, 0.5) == 8.5
    assert cooldown_s(1, 100, 10, 0.0) == 100  # bounded by HI
    assert cooldown_s(1, 2, 1, 0.9) == 2  # upstream's test range: always HI
    assert cooldown_s(0.5, 3600, 1000, 1.0) == 3600  # no overflow


def test_too_few_workers_for_min_np_ends_with_clear_error(tmp_path):
    rc, out = _run(tmp_path, "localhost:2", {"KILL_RANK": "1", "KILL_STEP": "3"},
                   ["-np", "2", "--min-np", "2", "--max-np", "2", "--elastic-timeout", "3"],
                   timeout=120)
    assert rc == 1, out
    assert "fewer than --min-np 2" in out, out


def test_every_host_blacklisted_is_a_clear_error(tmp_path):
    rc, out = _run(tmp_path, "localhost:1", {"KILL_RANK": "0", "KILL_STEP": "3"},
                   ["-np", "1", "--min-np", "1", "--max-np", "1"], timeout=120)
    assert rc == 1, out
    assert "every host has failed and is blacklisted" in out, out


def _worker_pid(worker_id):
    """PID of the elastic worker with this HOROVOD_ELASTIC_WORKER_ID."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"HOROVOD_ELASTIC_WORKER_ID={worker_id}".encode() in env:
            return int(pid)
    return None


def test_oci_train_script_survives_a_kill_and_a_new_host(tmp_path):
    """The OCI guide's train.py, unmodified: 2 workers on two local hosts, one killed
    mid-epoch, a third host added later; training finishes, rank 0 writes the
    checkpoints and TensorBoard logs under $OCI__SYNC_DIR/artifacts.

    Known issue (2026-11-26): about one run in ten under load, the job did not finish
    after the kill and the new host (an elastic hang, cause not found). Not seen since:
    37 runs of 2026-11-27 (12 quiet, 25 with both CPUs busy) all finished. The scenario
    still gets one more try, and the first attempt's output is printed; two hangs fail
    the test."""
    try:
        _oci_kill_and_add_host(tmp_path / "try1")
    except AssertionError as e:
        if "did not finish within 240 s" not in str(e):
            raise
        print("first attempt hung (known intermittent elastic hang):\n" + str(e)[-6000:])
        _oci_kill_and_add_host(tmp_path / "try2")


def _oci_kill_and_add_host(tmp_path):
    tmp_path.mkdir(parents=True)
    import signal
    import threading
    import time
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "horovod_torch.data", "mnist", str(data),
                    "--train-size", "3000", "--test-size", "500"], check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=ROOT))
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("localhost:1\n127.0.0.2:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    sync_dir = tmp_path / "oci"
    env = dict(os.environ, PYTHONPATH=ROOT, OCI__SYNC_DIR=str(sync_dir), OMP_NUM_THREADS="1",
               HOME=str(tmp_path))
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", "2", "--min-np", "1",
           "--max-np", "3", "--host-discovery-script", str(discover), sys.executable,
           os.path.join(ROOT, "examples", "elastic", "train.py"), "--data-dir", str(data),
           "--epochs", "10", "--batch-size", "32"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while sum("Train Epoch: 1 [" in x for x in lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = _worker_pid("127.0.0.2/1")
        assert pid, "".join(lines)
        os.kill(pid, signal.SIGKILL)
        # The survivor waits (stopped) until the new host's worker has joined: alone it
        # may finish the training before that worker, which imports torch, gets there.
        survivor = _worker_pid("localhost/0")
        assert survivor, "".join(lines)
        os.kill(survivor, signal.SIGSTOP)
        try:
            hosts_file.write_text("localhost:1\n127.0.0.2:1\n127.0.0.3:1\n")
            deadline = time.monotonic() + 120
            while (not any("127.0.0.3:1" in x for x in lines)
                   and time.monotonic() < deadline and proc.poll() is None):
                time.sleep(0.2)
        finally:
            os.kill(survivor, signal.SIGCONT)
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            raise AssertionError("the elastic job did not finish within 240 s after the "
                                 "kill:\n" + "".join(lines[-200:])) from None
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "exited with code 137" in out, out
    assert "127.0.0.3:1" in out, "the new host never joined:\n" + out
    assert out.count("Test set: Average loss") == 1, out
    ckpts = sorted(p.name for p in (sync_dir / "artifacts" / "ckpts").iterdir())
    assert set(ckpts) == {f"checkpoint-{e}.pth.tar" for e in range(2, 12)}, ckpts
    assert any(p.name.startswith("events.") for p in (sync_dir / "artifacts" / "logs").iterdir())
