"""The timeline (HOROVOD_TIMELINE, start_timeline/stop_timeline) and log lines."""
import json
import os
import re
import subprocess
import sys

from horovod_torch import timeline
from tests.harness import ROOT, run_workers


def _by_tensor(events):
    spans = timeline.spans(events)
    out = {}
    for s in spans:
        out.setdefault(s["tensor"], []).append(s)
    return out


def test_timeline_records_negotiation_and_phases_per_tensor(tmp_path):
    path = tmp_path / "timeline.json"
    run_workers("tests.observe_workers:timeline_run", 2, args=["0"], timeout=90,
                          env={"HOROVOD_TIMELINE": str(path),
                               "HOROVOD_TIMELINE_MARK_CYCLES": "1",
                               "HOROVOD_WAKE_DELAY_US": "20000"})  # fuse the three
    events = json.loads(path.read_text())  # strict JSON: closed at shutdown
    assert events[-1]["name"] == "TIMELINE_END"
    assert any(e.get("name") == "CYCLE_START" for e in events)
    # B and E balance for every tensor row, and time never runs backwards in a row.
    for pid in {e["pid"] for e in events if e.get("ph") in "BE"}:
        row = [e for e in events if e.get("pid") == pid and e.get("ph") in "BEi"]
        assert sum(e["ph"] == "B" for e in row) == sum(e["ph"] == "E" for e in row)
        assert [e["ts"] for e in row] == sorted(e["ts"] for e in row)
    tensors = _by_tensor(events)
    for i in range(3):
        names = [s["name"] for s in tensors[f"grad.{i}"]]
        assert "NEGOTIATE_ALLREDUCE" in names and "ALLREDUCE" in names, names
        assert "QUEUE" in names and "TCP_ALLREDUCE" in names, names
    # The three gradients were fused: copies into and out of the fusion buffer.
    fused = [s["name"] for s in tensors["grad.0"]]
    assert "MEMCPY_IN_FUSION_BUFFER" in fused and "MEMCPY_OUT_FUSION_BUFFER" in fused, fused
    assert "TCP_ALLGATHER" in [s["name"] for s in tensors["gathered"]]
    assert "TCP_BROADCAST" in [s["name"] for s in tensors["bcast"]]
    # Cached repeats are negotiated (by bits) and recorded too: 3 rounds.
    assert [s["name"] for s in tensors["repeat"]].count("NEGOTIATE_ALLREDUCE") == 3
    # Each negotiation marks when each rank became ready.
    pid = next(e["pid"] for e in events if e.get("ph") == "M"
               and e["args"].get("name") == "grad.0")
    marks = {e["name"] for e in events if e.get("ph") == "i" and e.get("pid") == pid}
    assert marks == {"0", "1"}, marks


def test_timeline_of_a_killed_job_is_readable(tmp_path):
    path = tmp_path / "timeline.json"
    results = run_workers("tests.observe_workers:timeline_run", 2, args=["1"], timeout=90,
                          env={"HOROVOD_TIMELINE": str(path)}, expect_ok=False)
    assert results[0].returncode == -9, results[0].output
    text = path.read_text()
    assert not text.rstrip().endswith("]")  # never closed
    # Cut the last line in half too, as a crash mid-write would.
    path.write_text(text.rstrip("\n")[:-7])
    events = timeline.load(path)
    assert len(events) > 20
    assert {"grad.0", "gathered", "bcast"} <= set(_by_tensor(events))


def test_start_and_stop_timeline_with_dynamic(tmp_path):
    path = tmp_path / "dyn.json"
    run_workers("tests.observe_workers:timeline_dynamic", 2, args=[str(path)], timeout=90,
                env={"HOROVOD_TIMELINE": "DYNAMIC"})
    events = json.loads(path.read_text())
    tensors = set(_by_tensor(events))
    assert tensors == {"during"}, tensors
    assert any(e.get("name") == "CYCLE_START" for e in events)


def test_log_lines_carry_rank_and_optional_timestamp(tmp_path):
    stamp = re.compile(r"\[horovod_torch info rank 0 \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z\] "
                       r"rank 0 of 1 ready")
    plain = re.compile(r"\[horovod_torch info rank 0\] rank 0 of 1 ready")
    for hide, pattern in (("0", stamp), ("1", plain)):
        results = run_workers("tests.observe_workers:timeline_dynamic", 1,
                              args=[str(tmp_path / "t.json")], timeout=60,
                              env={"HOROVOD_LOG_LEVEL": "info", "HOROVOD_LOG_HIDE_TIME": hide})
        assert pattern.search(results[0].output), results[0].output


def test_plot_timeline_example_renders_a_png(tmp_path):
    path, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    run_workers("tests.observe_workers:timeline_run", 2, args=["0"], timeout=90,
                env={"HOROVOD_TIMELINE": str(path), "HOROVOD_WAKE_DELAY_US": "20000"})
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "plot_timeline.py"),
                          str(path), str(png), "--time-ms", "0:100000"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The three rounds of "repeat" are the steps; the window is the whole run.
    assert "wrote" in out.stdout and "3 steps, 0-100000 ms: 7 tensors" in out.stdout, out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_steps_split_compute_wait_and_communication():
    """timeline.steps on hand-made spans: two gradients a and b, three rounds; a
    broadcast seen once falls in the first step."""
    def span(tensor, name, start, end):
        return {"tensor": tensor, "name": name, "start": start, "end": end, "depth": 0}
    spans = [span("bcast", "NEGOTIATE_BROADCAST", 0, 5), span("bcast", "BROADCAST", 5, 10)]
    for i in range(3):
        t = 100 + 1000 * i  # compute until t; b is asked for at t, a at t + 200 (late rank)
        spans += [span("b", "NEGOTIATE_ALLREDUCE", t, t + 300),
                  span("a", "NEGOTIATE_ALLREDUCE", t + 200, t + 300),
                  span("a", "ALLREDUCE", t + 300, t + 400),
                  span("b", "ALLREDUCE", t + 300, t + 400),
                  {"tensor": "a", "name": "QUEUE", "start": t + 300, "end": t + 310, "depth": 1}]
    steps = timeline.steps(spans)
    assert [(s["start"], s["end"]) for s in steps] == [(100, 1100), (1100, 2100), (2100, 2500)]
    for s in steps:
        assert s["wait"] == 300 and s["comm"] == 100, s
    assert [s["compute"] for s in steps] == [600, 600, 0]
    assert timeline.steps([]) == []
    # Two steps of one gradient after five tensors broadcast once: still two steps.
    once = [span(f"p{i}", "NEGOTIATE_BROADCAST", i, i + 1) for i in range(5)]
    grads = [span("g", "NEGOTIATE_ALLREDUCE", t, t + 10) for t in (100, 200)]
    assert len(timeline.steps(once + grads)) == 2


def test_plot_timeline_of_training_shows_steps_and_the_wait(tmp_path):
    path, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    run_workers("tests.observe_workers:timeline_training", 2, args=["6"], timeout=120,
                env={"HOROVOD_TIMELINE": str(path)})
    steps = timeline.steps(timeline.spans(timeline.load(path)))
    assert len(steps) == 6, steps
    middle = sorted(steps[1:-1], key=lambda s: s["wait"])[len(steps[1:-1]) // 2]
    # Rank 1 computes 20 ms longer each step: rank 0 waits for it; both compute 30 ms.
    assert middle["wait"] >= 10_000, steps
    assert middle["compute"] >= 20_000, steps
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "plot_timeline.py"),
                          str(path), str(png), "--steps", "2:3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "6 steps, steps 2-3:" in out.stdout, out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "plot_timeline.py"),
                          str(path), str(png), "--steps", "4:9"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "the file holds steps 0:5" in bad.stderr, bad.stderr


def test_horovodrun_knob_flags_reach_the_workers(tmp_path):
    timeline_path, log = tmp_path / "t.json", tmp_path / "autotune.csv"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               HOROVOD_AUTOTUNE_WARMUP_SAMPLES="0", HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="2",
               HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES="3")
    out = subprocess.run(["horovodrun", "-np", "2", "--timeline-filename", str(timeline_path),
                          "--timeline-mark-cycles", "--autotune", "--autotune-log-file", str(log),
                          "--fusion-threshold-mb", "2", "--log-hide-timestamp",
                          "--log-level", "info",
                          sys.executable, "-m", "tests.run_worker",
                          "tests.observe_workers:autotune_run", "40"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-4000:]
    events = json.loads(timeline_path.read_text())
    assert any(e.get("name") == "CYCLE_START" for e in events)
    assert "best" in log.read_text()
    assert re.search(r"\[horovod_torch info rank 0\] rank 0 of 2 ready: .*fusion threshold "
                     r"2097152 bytes", out.stdout), out.stdout[-3000:]
