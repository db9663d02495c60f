"""Render a horovod_torch timeline (HOROVOD_TIMELINE=...json) as a PNG.

    python examples/plot_timeline.py timeline.json timeline.png [--steps 10:13]
        [--time-ms 1200:1450] [--tensors 30]

Two panels. The upper one shows, for every training step of the file, how its time
split as the coordinator saw it: computing (the engine had nothing to do), waiting
for the slowest rank (some rank asked for a tensor and another had not yet), and
communicating (a collective ran); the steps drawn below are shaded. The lower one is
a window of the run (by default 3 steps in the middle; --steps or --time-ms choose
another): one row per tensor (the first --tensors that appear in the window), a bar
for each phase (negotiation, queue, copies into and out of the fusion buffer, the
collective), and a tick on the negotiation bar where each rank became ready (labelled
with the rank when there are few). A step is one round of the tensors that recur most
(the gradients; horovod_torch.timeline.steps). Works on the file of a killed job too
(its complete events are read).

To produce a timeline:
    HOROVOD_TIMELINE=/tmp/timeline.json horovodrun -np 2 python train.py
or call hvd.start_timeline(path) / hvd.stop_timeline() around the steps of interest.
"""
import argparse
from typing import Optional, Tuple

from horovod_torch import extras, timeline

matplotlib = extras.require("matplotlib", "examples/plot_timeline.py")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"NEGOTIATE": "#c7c7c7", "QUEUE": "#ffbb78", "MEMCPY_IN_FUSION_BUFFER": "#98df8a",
          "MEMCPY_OUT_FUSION_BUFFER": "#2ca02c"}
OP_COLOR = "#1f77b4"
PARTS = (("compute", "computing", "#9ecae1"), ("wait", "waiting for the slowest rank", "#fdae6b"),
         ("comm", "communicating", "#3182bd"))
MAX_RANK_LABELS = 8  # rank ticks are labelled only up to this many ranks


def color_of(name: str) -> str:
    if name.startswith("NEGOTIATE"):
        return COLORS["NEGOTIATE"]
    return COLORS.get(name, OP_COLOR)


def _range(text: Optional[str], what: str) -> Optional[Tuple[float, float]]:
    if text is None:
        return None
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"{what} takes FIRST:LAST (numbers), not {text!r}") from None
    if b < a:
        raise SystemExit(f"{what} {text}: LAST is before FIRST")
    return a, b


def window(steps, spans, by_steps, by_ms) -> Tuple[float, float, str]:
    """The time window of the lower panel (us) and its description."""
    t0 = min(s["start"] for s in spans)
    if by_ms is not None:
        return t0 + by_ms[0] * 1000, t0 + by_ms[1] * 1000, f"{by_ms[0]:g}-{by_ms[1]:g} ms"
    if not steps:
        return t0, max(s["end"] for s in spans), "the whole file"
    if by_steps is None:
        mid = len(steps) // 2
        first, last = max(0, mid - 1), min(len(steps) - 1, mid + 1)
    else:
        first, last = int(by_steps[0]), int(by_steps[1])
        if not 0 <= first <= last < len(steps):
            raise SystemExit(f"--steps {first}:{last}: the file holds steps 0:{len(steps) - 1}")
    what = f"step {first}" if first == last else f"steps {first}-{last}"
    return steps[first]["start"], steps[last]["end"], what


def short(name: str, width: int = 40) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]


def plot_steps(ax, steps, lo, hi) -> None:
    x = range(len(steps))
    bottom = [0.0] * len(steps)
    for key, label, color in PARTS:
        ms = [s[key] / 1000 for s in steps]
        ax.bar(x, ms, bottom=bottom, color=color, label=label, width=0.9)
        bottom = [b + m for b, m in zip(bottom, ms)]
    shown = [i for i, s in enumerate(steps) if s["end"] > lo and s["start"] < hi]
    if shown:
        ax.axvspan(shown[0] - 0.5, shown[-1] + 0.5, color="#000000", alpha=0.08, lw=0)
    total = {k: sum(s[k] for s in steps) for k, _, _ in PARTS}
    whole = sum(total.values()) or 1.0
    ax.set_title("per step: " + ", ".join(f"{label} {100 * total[k] / whole:.0f}%"
                                          for k, label, _ in PARTS), fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def plot_window(ax, events, spans, lo, hi, rows: int, what: str) -> int:
    inside = [s for s in spans if s["end"] >= lo and s["start"] <= hi]
    first = {}
    for s in inside:
        first[s["tensor"]] = min(first.get(s["tensor"], s["start"]), s["start"])
    tensors = sorted(first, key=first.get)[:rows]
    row = {t: i for i, t in enumerate(tensors)}
    seen = set()
    for s in inside:
        if s["tensor"] not in row:
            continue
        y, left = row[s["tensor"]], (max(s["start"], lo) - lo) / 1000
        width = (min(s["end"], hi) - max(s["start"], lo)) / 1000
        if s["depth"] == 0 and not s["name"].startswith("NEGOTIATE"):  # the op's outline
            ax.barh(y, width, left=left, height=0.8, color="none", edgecolor="#555555",
                    linewidth=0.6)
            continue
        key = "NEGOTIATE" if s["name"].startswith("NEGOTIATE") else s["name"]
        ax.barh(y, max(width, 0.002), left=left, height=0.8 if s["depth"] == 0 else 0.45,
                color=color_of(s["name"]), label=None if key in seen else key)
        seen.add(key)
    pids = {e["args"]["name"]: e["pid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_pid = {pid: t for t, pid in pids.items()}
    ticks = [e for e in events if e.get("ph") == "i" and e.get("s") == "p"
             and by_pid.get(e["pid"]) in row and lo <= e["ts"] <= hi]
    label_ranks = len({e["name"] for e in ticks}) <= MAX_RANK_LABELS
    for e in ticks:
        x, y = (e["ts"] - lo) / 1000, row[by_pid[e["pid"]]]
        ax.plot([x, x], [y - 0.4, y + 0.4], color="black", lw=0.6)
        if label_ranks:
            ax.text(x, y - 0.45, e["name"], fontsize=6, ha="center", va="bottom")
    ax.set_yticks(range(len(tensors)))
    ax.set_yticklabels([short(t) for t in tensors], fontsize=7)
    ax.set_ylim(len(tensors) - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) / 1000)
    ax.set_xlabel(f"ms since the start of {what}")
    ax.set_title(f"{what}: {len(tensors)} of {len(first)} tensors", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return len(tensors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("timeline")
    p.add_argument("png")
    p.add_argument("--steps", help="FIRST:LAST steps to show in the lower panel "
                   "(0-based; default 3 in the middle)")
    p.add_argument("--time-ms", help="FIRST:LAST ms after the first event, instead of steps")
    p.add_argument("--tensors", type=int, default=30, help="rows to draw at most (default 30)")
    a = p.parse_args()
    events = timeline.load(a.timeline)
    spans = timeline.spans(events)
    if not spans:
        raise SystemExit(f"{a.timeline} holds no spans: was any collective run while it "
                         "was recording?")
    steps = timeline.steps(spans)
    lo, hi, what = window(steps, spans, _range(a.steps, "--steps"), _range(a.time_ms, "--time-ms"))
    rows = min(a.tensors, len({s["tensor"] for s in spans}))
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 3.2 + 0.28 * rows + 1.6),
        gridspec_kw={"height_ratios": [3.2, 0.28 * rows + 1.6]})
    plot_steps(top, steps, lo, hi)
    n = plot_window(bottom, events, spans, lo, hi, a.tensors, what)
    fig.suptitle(f"horovod_torch timeline: {a.timeline}", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    print(f"wrote {a.png}: {len(steps)} steps, {what}: {n} tensors, {len(spans)} spans")


if __name__ == "__main__":
    main()
