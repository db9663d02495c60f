"""Reading the timeline (``HOROVOD_TIMELINE`` / ``hvd.start_timeline``).

The coordinator writes a Chrome-trace JSON array one event per line and closes
the array at shutdown. A job that was killed leaves the array open, possibly with
a half-written last line: :func:`load` returns every complete event either way.
"""
import bisect
import json
import os
from typing import Any, Dict, List, Tuple


def load(path: "os.PathLike[str] | str") -> List[Dict[str, Any]]:
    """Every complete event of the timeline at ``path``, in file order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    events = []
    for line in text.splitlines()[1:]:  # the first line is "["
        line = line.strip().rstrip(",")
        if not line or line == "]":
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the cut-off tail of a killed job
    return events


def spans(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Pairs B/E events into spans: dicts with tensor, name, start, end (us) and
    depth (0 for NEGOTIATE_* and the op, 1 for its activities). Spans left open by
    a killed job end at the last timestamp in the file."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    stacks: Dict[int, list] = {}
    out = []
    last = max((e.get("ts", 0) for e in events), default=0)
    for e in events:
        ph = e.get("ph")
        if ph == "B":
            stacks.setdefault(e["pid"], []).append(e)
        elif ph == "E" and stacks.get(e["pid"]):
            b = stacks[e["pid"]].pop()
            out.append({"tensor": names.get(e["pid"], str(e["pid"])), "name": b["name"],
                        "start": b["ts"], "end": e["ts"], "depth": len(stacks[e["pid"]])})
    for pid, stack in stacks.items():
        for depth, b in enumerate(stack):
            out.append({"tensor": names.get(pid, str(pid)), "name": b["name"],
                        "start": b["ts"], "end": last, "depth": depth})
    return out


Intervals = List[Tuple[float, float]]


def _union(intervals: Intervals) -> Intervals:
    """The union of `intervals` as disjoint, sorted intervals (empty ones dropped)."""
    out: Intervals = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _minus(xs: Intervals, ys: Intervals) -> Intervals:
    """The parts of the (disjoint, sorted) intervals xs outside the (disjoint, sorted) ys,
    in one sweep over both."""
    out: Intervals = []
    j = 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            c, d = ys[k]
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
            k += 1
        if a < b:
            out.append((a, b))
    return out


def _per_step(intervals: Intervals, bounds: List[float]) -> List[float]:
    """How much of the (disjoint, sorted) intervals falls in each [bounds[i], bounds[i+1])."""
    out = [0.0] * (len(bounds) - 1)
    for a, b in intervals:
        i = max(0, bisect.bisect_right(bounds, a) - 1)
        while i < len(out) and bounds[i] < b:
            lo, hi = max(a, bounds[i]), min(b, bounds[i + 1])
            if hi > lo:
                out[i] += hi - lo
            i += 1
    return out


def steps(spans_: List[Dict[str, Any]]) -> List[Dict[str, float]]:
    """Splits a training run's timeline into steps, and each step's time into three parts
    as the coordinator saw them (times in us):

    - ``comm``: a collective was running (an op span, its copies included);
    - ``wait``: some rank had asked for a tensor and another had not (a NEGOTIATE span:
      the wait for the slowest rank), outside ``comm``;
    - ``compute``: neither: the ranks computed (forward, backward up to the first
      gradient, the optimizer) while the engine had nothing to do.

    A step is one round of the tensors that recur most often (the gradients): step i
    runs from the i-th negotiation of the first of them to the (i+1)-th (the last step
    to the end of its last op). Tensors seen fewer times (a broadcast at the start)
    count only in the time of the step they fall in. Returns one dict per step with
    start, end, comm, wait, compute."""
    negotiations: Dict[str, List[float]] = {}
    for s in spans_:
        if s["depth"] == 0 and s["name"].startswith("NEGOTIATE"):
            negotiations.setdefault(s["tensor"], []).append(s["start"])
    if not negotiations:
        return []
    counts: Dict[int, int] = {}
    for starts in negotiations.values():
        counts[len(starts)] = counts.get(len(starts), 0) + 1
    # The gradients' count: of the counts above one (tensors seen once, such as the
    # parameters and optimizer state broadcast at the start, are not steps), the one
    # with the most negotiations in all.
    recurring_counts = {n: c for n, c in counts.items() if n > 1} or counts
    rounds = max(recurring_counts, key=lambda n: (counts[n] * n, n))
    recurring = {t for t, v in negotiations.items() if len(v) == rounds}
    starts = [sorted(negotiations[t]) for t in recurring]
    bounds = [min(v[i] for v in starts) for i in range(rounds)]
    # The last step ends with the last op of its tensors (ops after it are not a step).
    bounds.append(max(s["end"] for s in spans_ if s["tensor"] in recurring))
    comm = _union([(s["start"], s["end"]) for s in spans_
                   if s["depth"] == 0 and not s["name"].startswith("NEGOTIATE")])
    wait = _minus(_union([(s["start"], s["end"]) for s in spans_
                          if s["depth"] == 0 and s["name"].startswith("NEGOTIATE")]), comm)
    out = []
    for a, b, c, w in zip(bounds, bounds[1:], _per_step(comm, bounds), _per_step(wait, bounds)):
        out.append({"start": a, "end": b, "comm": c, "wait": w,
                    "compute": max(0.0, (b - a) - c - w)})
    return out
