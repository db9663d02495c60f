"""Bad input, disagreeing ranks, dead peers and re-initialisation."""
import os
import re
import subprocess
import sys

import pytest

from tests.harness import ROOT, run_workers


def test_cross_rank_mismatches_raise_runtime_error_and_engine_survives():
    run_workers("tests.workers:mismatches", 2, timeout=90)


def test_local_bad_input_raises_value_error():
    run_workers("tests.workers:local_errors", 2, timeout=90)


@pytest.mark.parametrize("mode", ["exit", "kill"])
def test_dead_peer_fails_survivors_with_internal_error(mode):
    results = run_workers("tests.workers:dead_peer", 3, args=[mode], timeout=90,
                          expect_ok=False)
    assert results[2].returncode in (17, -9), results[2]
    for r in results[:2]:
        assert r.returncode == 0, r.output
        assert "dead peer noticed" in r.output


def test_dead_peer_in_shared_memory_fails_survivors_and_leaves_nothing():
    """Every op through the host's segment: a SIGKILLed rank is seen by the others
    (its pid is watched) within seconds, and no file is left in /dev/shm."""
    # Only our files: other processes on a busy machine come and go in /dev/shm (#22).
    def ours():
        return {f for f in os.listdir("/dev/shm") if f.startswith("horovod_torch")}
    before = ours()
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
    results = run_workers("tests.workers:dead_peer", 3, args=["kill"], env=env, timeout=90,
                          expect_ok=False)
    assert results[2].returncode == -9, results[2]
    for r in results[:2]:
        assert r.returncode == 0, r.output
        assert "dead peer noticed" in r.output
    assert ours() <= before


def test_reinit_many_times():
    run_workers("tests.workers:reinit", 2, args=[40], timeout=120)


@pytest.mark.parametrize("knob,value", [("HOROVOD_SMALL_ALLREDUCE_BYTES", "1000000"),
                                        ("HOROVOD_FUSION_THRESHOLD", "1024"),
                                        ("HOROVOD_SHM_CONTROL", "1"),
                                        ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
                                        ("HOROVOD_C10D_CUDA_DIRECT", "0")])
def test_settings_that_must_agree_are_compared_at_init(knob, value):
    """A per-host difference in a knob that picks the protocol gave wrong sums or a
    60 s hang; now init() refuses on every rank and says which knob differs."""
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_SHM_CONTROL": "0"}
    results = run_workers("tests.workers:settings_differ", 2, args=[knob], env=env,
                          per_rank_env=lambda r: {knob: value} if r == 1 else {}, timeout=60)
    assert all("settings checked" in r.output for r in results)


@pytest.mark.parametrize("hierarchical", ["0", "1"])
def test_fork_after_init_leaves_the_parent_working(hierarchical):
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": hierarchical}
    run_workers("tests.workers:fork_after_init", 2, env=env, timeout=60)


def test_init_after_the_engine_stopped_brings_up_a_new_one():
    run_workers("tests.workers:reinit_after_engine_stopped", 2, timeout=60)


def test_world_of_one_without_launcher():
    code = ("import horovod.torch as hvd, torch\n"
            "hvd.init(); assert (hvd.rank(), hvd.size(), hvd.local_rank()) == (0, 1, 0)\n"
            "assert hvd.allreduce(torch.ones(3)).tolist() == [1.0] * 3\n"
            "assert hvd.allgather(torch.ones(2, 2)).shape == (2, 2)\n"
            "hvd.shutdown(); hvd.init(); hvd.barrier(); print('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_wrong_secret_cannot_join():
    results = run_workers("tests.workers:reinit", 2, args=[1], timeout=60, expect_ok=False,
                          env={"HOROVOD_START_TIMEOUT": "5"},
                          per_rank_env=lambda r: {"HOROVOD_SECRET": "wrong"} if r == 1 else {})
    assert results[1].returncode != 0
    assert "secret" in results[1].output, results[1].output


def test_stalled_collective_is_reported_and_fails_the_job():
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    results = run_workers("tests.workers:stall", 2, env=env, timeout=90)
    assert "stalled collectives" in results[0].output  # the coordinator's warning
    assert "missing on ranks [1]" in results[0].output
    # ... and the waiting rank says where it waits, in the user's code.
    assert "waited 1 s for 'skipped_by_1' at " in results[0].output, results[0].output
    assert "workers.py:" in results[0].output.split("for 'skipped_by_1' at ")[1].split()[0]
    # The coordinator's one message also says where each waiting rank waits: rank 0
    # in the stalled op; rank 1 sleeps, so it waits nowhere.
    report = results[0].output[results[0].output.index("stalled collectives"):]
    assert re.search(r"where the ranks wait \(the Python caller\):\n.*rank 0 waits for "
                     r"'skipped_by_1' at \S*workers\.py:\d+", report), report
    assert "rank 1 waits" not in report.split("stopping the job")[0], report


def test_a_stall_ends_the_job_by_default():
    """Without any stall knob, a collective one rank never calls fails the job after
    600 s (what happens then is the test above, with a short bound)."""
    from horovod_torch import config
    defaults = {k[0]: k[2] for k in config.knobs()}
    assert defaults["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == 600.0
