"""Render a horovod_torch timeline (HOROVOD_TIMELINE=...json) as a PNG.

    python examples/plot_timeline.py timeline.json timeline.png [--tensors 20]

One row per tensor (the first N by start time): a bar for each phase (negotiation,
queue, copies into and out of the fusion buffer, the collective), and a tick on
the negotiation bar where each rank became ready, labelled with the rank. Works
on the file of a killed job too (its complete events are read).

To produce a timeline:
    HOROVOD_TIMELINE=/tmp/timeline.json horovodrun -np 2 python train.py
or call hvd.start_timeline(path) / hvd.stop_timeline() around the steps of interest.
"""
import argparse

from horovod_torch import extras, timeline

matplotlib = extras.require("matplotlib", "examples/plot_timeline.py")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"NEGOTIATE": "#c7c7c7", "QUEUE": "#ffbb78", "MEMCPY_IN_FUSION_BUFFER": "#98df8a",
          "MEMCPY_OUT_FUSION_BUFFER": "#2ca02c"}
OP_COLOR = "#1f77b4"


def color_of(name: str) -> str:
    if name.startswith("NEGOTIATE"):
        return COLORS["NEGOTIATE"]
    return COLORS.get(name, OP_COLOR)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("timeline")
    p.add_argument("png")
    p.add_argument("--tensors", type=int, default=20, help="rows to draw (default 20)")
    a = p.parse_args()
    events = timeline.load(a.timeline)
    spans = timeline.spans(events)
    if not spans:
        raise SystemExit(f"{a.timeline} holds no spans: was any collective run while it "
                         "was recording?")
    first = {}
    for s in spans:
        first[s["tensor"]] = min(first.get(s["tensor"], s["start"]), s["start"])
    tensors = sorted(first, key=first.get)[:a.tensors]
    row = {t: i for i, t in enumerate(tensors)}
    t0 = min(first[t] for t in tensors)
    pids = {e["args"]["name"]: e["pid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(tensors) + 1.5))
    seen = set()
    for s in spans:
        if s["tensor"] not in row:
            continue
        y = row[s["tensor"]]
        # Ops and negotiation fill the row; activities are drawn thinner on top.
        height = 0.8 if s["depth"] == 0 else 0.45
        label = None
        key = "NEGOTIATE" if s["name"].startswith("NEGOTIATE") else s["name"]
        if key not in seen and (s["depth"] > 0 or key == "NEGOTIATE"):
            seen.add(key)
            label = key
        if s["depth"] == 0 and not s["name"].startswith("NEGOTIATE"):
            ax.barh(y, (s["end"] - s["start"]) / 1000, left=(s["start"] - t0) / 1000,
                    height=height, color="none", edgecolor="#555555", linewidth=0.6)
            continue
        ax.barh(y, max((s["end"] - s["start"]) / 1000, 0.002), left=(s["start"] - t0) / 1000,
                height=height, color=color_of(s["name"]), label=label)
    for e in events:  # rank-ready ticks inside NEGOTIATE
        if e.get("ph") != "i" or e.get("s") != "p":
            continue
        tensor = next((t for t, pid in pids.items() if pid == e["pid"]), None)
        if tensor in row:
            x = (e["ts"] - t0) / 1000
            ax.plot([x, x], [row[tensor] - 0.4, row[tensor] + 0.4], color="black", lw=0.8)
            ax.text(x, row[tensor] + 0.42, e["name"], fontsize=6, ha="center")
    ax.set_yticks(range(len(tensors)))
    ax.set_yticklabels(tensors, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since the first event shown (ms)")
    ax.set_title(f"horovod_torch timeline: {a.timeline}")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    print(f"wrote {a.png}: {len(tensors)} tensors, {len(spans)} spans")


if __name__ == "__main__":
    main()
