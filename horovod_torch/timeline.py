"""Reading the timeline (``HOROVOD_TIMELINE`` / ``hvd.start_timeline``).

The coordinator writes a Chrome-trace JSON array one event per line and closes
the array at shutdown. A job that was killed leaves the array open, possibly with
a half-written last line: :func:`load` returns every complete event either way.
"""
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


def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _length(intervals: List[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


Intervals = List[Tuple[float, float]]


def _minus(xs: Intervals, ys: Intervals) -> Intervals:
    """The parts of the (disjoint, sorted) intervals xs outside the (disjoint, sorted) ys."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
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
    rounds = max(counts, key=lambda n: (counts[n] * n, n))  # the gradients' count
    recurring = [sorted(v) for v in negotiations.values() if len(v) == rounds]
    bounds = [min(v[i] for v in recurring) for i in range(rounds)]
    end = max(s["end"] for s in spans_)
    bounds.append(end)
    comm = _union([(s["start"], s["end"]) for s in spans_
                   if s["depth"] == 0 and not s["name"].startswith("NEGOTIATE")])
    wait = _minus(_union([(s["start"], s["end"]) for s in spans_
                          if s["depth"] == 0 and s["name"].startswith("NEGOTIATE")]), comm)

    def within(xs, a, b):  # the time of the intervals xs between a and b
        return _length(_union([(max(x, a), min(y, b)) for x, y in xs if y > a and x < b]))

    out = []
    for a, b in zip(bounds, bounds[1:]):
        c, w = within(comm, a, b), within(wait, a, b)
        out.append({"start": a, "end": b, "comm": c, "wait": w,
                    "compute": max(0.0, (b - a) - c - w)})
    return out
