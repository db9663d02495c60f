"""Autotune: the coordinator's search changes fusion threshold, wake delay and the
response cache mid-run; every result stays exact and every rank ends on the same
setting."""
import csv
import json

from tests.harness import run_workers


def test_autotune_searches_then_every_rank_keeps_the_same_setting(tmp_path):
    log = tmp_path / "autotune.csv"
    results = run_workers("tests.observe_workers:autotune_run", 2, args=["150"], timeout=120,
                          env={"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                               "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
                               "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3",
                               "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "8",
                               "HOROVOD_LOG_LEVEL": "info"})
    line = next(x for x in results[0].output.splitlines() if x.startswith("PARAMS "))
    params = json.loads(line[len("PARAMS "):])
    assert params[0]["autotune_done"], params
    for p in params:
        p.pop("autotune_done")
    assert params[0] == params[1], params
    assert "autotune: keeping" in results[0].output
    rows = list(csv.DictReader(log.open()))
    phases = [r["phase"] for r in rows]
    assert phases.count("warmup") == 1 and phases.count("sample") == 8, phases
    assert phases[-1] == "best"
    best = rows[-1]
    assert int(best["fusion_threshold_bytes"]) == params[0]["fusion_threshold_bytes"]
    assert float(best["wake_delay_us"]) == params[0]["wake_delay_us"]
    assert bool(int(best["cache_enabled"])) == params[0]["cache_enabled"]
    settings = {(r["fusion_threshold_bytes"], r["wake_delay_us"], r["cache_enabled"])
                for r in rows if r["phase"] == "sample"}
    assert len(settings) == 8, "each sample should try a new setting"
    assert all(float(r["score_bytes_per_s"]) > 0 for r in rows)


def test_autotune_off_by_default_keeps_the_configured_setting():
    results = run_workers("tests.observe_workers:autotune_run", 2, args=["5"], timeout=60,
                          env={"HOROVOD_FUSION_THRESHOLD": str(1 << 20),
                               "HOROVOD_WAKE_DELAY_US": "50"})
    line = next(x for x in results[0].output.splitlines() if x.startswith("PARAMS "))
    for p in json.loads(line[len("PARAMS "):]):
        assert p == {"fusion_threshold_bytes": 1 << 20, "wake_delay_us": 50.0,
                     "cache_enabled": True, "autotune_done": True}, p
