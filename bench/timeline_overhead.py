"""Cost of the timeline on training throughput: the synthetic benchmark with the
timeline off and on (with cycle marks), alternating, same machine, same run.

    python bench/timeline_overhead.py --np 2 [--no-cuda] [--model resnet50] [--rounds 2]
"""
import argparse
import os
import statistics
import tempfile

from _launch import run_synthetic


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("extra", nargs="*", help="more synthetic-benchmark arguments (after --)")
    a = p.parse_args()
    base = ["--model", a.model, "--batch-size", str(a.batch_size), "--num-iters",
            str(a.num_iters), *(["--no-cuda"] if a.no_cuda else []), *a.extra]
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        for _ in range(a.rounds):
            off.append(run_synthetic(a.np, base, {}))
            on.append(run_synthetic(a.np, base, {"HOROVOD_TIMELINE": path,
                                                 "HOROVOD_TIMELINE_MARK_CYCLES": "1"}))
            size = os.path.getsize(path)
    print(f"synthetic benchmark {' '.join(base)} on {a.np} ranks, {a.rounds} rounds")
    print(f"timeline off: {statistics.median(off):.1f} img/s (runs {off})")
    print(f"timeline on:  {statistics.median(on):.1f} img/s (runs {on}); file {size >> 10} KB")
    print(f"on / off: {statistics.median(on) / statistics.median(off):.3f}")


if __name__ == "__main__":
    main()
