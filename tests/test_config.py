"""docs/config.md is generated from the knob list and must stay in sync."""
import os

import pytest

from tests.harness import ROOT


def test_docs_config_is_up_to_date():
    from horovod_torch.config import markdown
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read() == markdown(), \
            "docs/config.md is stale: run python -m horovod_torch.config --markdown > docs/config.md"


def test_bad_knob_value_is_a_clear_error(monkeypatch):
    import horovod_torch as hvd
    import pytest
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "lots")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "soon")
    with pytest.raises(ValueError) as e:
        hvd.init()
    msg = str(e.value)
    assert ("HOROVOD_FUSION_THRESHOLD='lots' is not an integer (python -m horovod_torch.config "
            "lists every knob)") in msg, msg
    assert "HOROVOD_CYCLE_TIME='soon' is not a number" in msg, msg
    assert not msg.endswith("; "), msg
    assert not hvd.is_initialized()


@pytest.mark.parametrize("env,value,allowed", [
    ("HOROVOD_TCP_TIMEOUT", "0", "> 0"), ("HOROVOD_TCP_TIMEOUT", "-3", "> 0"),
    ("HOROVOD_START_TIMEOUT", "0", "> 0"), ("HOROVOD_CYCLE_TIME", "-1", "> 0"),
    ("HOROVOD_FUSION_THRESHOLD", "-5", ">= 0"), ("HOROVOD_RING_CHUNK_BYTES", "0", ">= 1"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "2", "-1, 0 or 1"),
    ("HOROVOD_SHM_THREADS", "0", ">= 1, or -1 (automatic)"),
    ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "1.5", "between 0 and 1"),
    ("HOROVOD_GPU_OP_TIMEOUT", "-1", ">= 0 (0: no limit)"),
])
def test_out_of_range_knob_is_a_clear_error(monkeypatch, env, value, allowed):
    """Before: accepted, and e.g. HOROVOD_TCP_TIMEOUT=0 failed every collective at once
    ("made no progress for 0.000003 s")."""
    import horovod_torch as hvd
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError) as e:
        hvd.init()
    assert f"{env}='{value}' is out of range: it must be {allowed} (" in str(e.value), e.value
    assert not hvd.is_initialized()


def test_horovod_stall_check_disable_silences_the_stall_report():
    """Horovod's HOROVOD_STALL_CHECK_DISABLE=1: no report for a 3 s stall that is
    reported without it (the check time is 1 s in both runs)."""
    from tests.harness import run_workers
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}
    loud = run_workers("tests.workers:late_rank", 2, args=["3"], env=env, timeout=60)
    assert "stalled collectives" in loud[0].output
    quiet = run_workers("tests.workers:late_rank", 2, args=["3"], timeout=60,
                        env=dict(env, HOROVOD_STALL_CHECK_DISABLE="1"))
    assert "stalled" not in quiet[0].output and "has waited" not in quiet[0].output


def test_horovod_thread_affinity_pins_the_background_thread():
    from tests.harness import run_workers
    run_workers("tests.workers:pinned_background_thread", 2,
                env={"HOROVOD_THREAD_AFFINITY": "0,1"}, timeout=60)


def test_horovod_gloo_timeout_bounds_the_rendezvous():
    """HOROVOD_GLOO_TIMEOUT_SECONDS=2 stands for the start timeout: rank 0 stops
    waiting for a rank that is not there within seconds (the default is 30 s)."""
    from tests.harness import run_workers
    results = run_workers("tests.workers:missing_rank_times_out", 2, timeout=60,
                          env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "2"})
    assert "gave up after" in results[0].output


def test_spark_start_timeout_is_a_listed_knob_and_a_bad_value_is_named(monkeypatch):
    import horovod_torch.spark as spark
    from horovod_torch import config
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HOROVOD_SPARK_START_TIMEOUT='soon' is not a number"):
        spark.run(print, num_proc=1)
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "12.5")
    assert config.spark_start_timeout_s() == 12.5
    monkeypatch.delenv("HOROVOD_SPARK_START_TIMEOUT")
    assert config.spark_start_timeout_s() == 600
    assert any(v == "HOROVOD_SPARK_START_TIMEOUT" for v, _, _ in config.LAUNCHER_VARS)
