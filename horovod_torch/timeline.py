"""Reading the timeline (``HOROVOD_TIMELINE`` / ``hvd.start_timeline``).

The coordinator writes a Chrome-trace JSON array one event per line and closes
the array at shutdown. A job that was killed leaves the array open, possibly with
a half-written last line: :func:`load` returns every complete event either way.
"""
import json
import os
from typing import Any, Dict, List


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
