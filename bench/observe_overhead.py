"""Cost of the engine's observation on training throughput: the synthetic benchmark
with one observer off and on, alternating, same machine, same run.

    python bench/observe_overhead.py --what timeline --np 2 [--no-cuda] [--model resnet50]
        [--rounds 2]
    python bench/observe_overhead.py --what stragglers --np 3 --no-cuda --rounds 5

--what timeline: the timeline (with cycle marks) against none; --what stragglers: the
straggler measurement (HOROVOD_STRAGGLER_CHECK=1, the default) against none (=0).
"""
import argparse
import os
import statistics
import tempfile

from _launch import run_synthetic


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", choices=("timeline", "stragglers"), default="timeline")
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
    note = ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        if a.what == "timeline":
            env_off = {}
            env_on = {"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
        else:
            env_off, env_on = {"HOROVOD_STRAGGLER_CHECK": "0"}, {"HOROVOD_STRAGGLER_CHECK": "1"}
        for i in range(a.rounds):
            # Which one goes first alternates, so a drift of the machine favours neither.
            for which in ((off, env_off), (on, env_on))[:: 1 if i % 2 == 0 else -1]:
                which[0].append(run_synthetic(a.np, base, which[1]))
            if a.what == "timeline":
                note = f"; file {os.path.getsize(path) >> 10} KB"
    print(f"synthetic benchmark {' '.join(base)} on {a.np} ranks, {a.rounds} rounds")
    print(f"{a.what} off: {statistics.median(off):.1f} img/s (runs {off})")
    print(f"{a.what} on:  {statistics.median(on):.1f} img/s (runs {on}){note}")
    print(f"on / off: {statistics.median(on) / statistics.median(off):.3f}")


if __name__ == "__main__":
    main()
