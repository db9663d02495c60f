"""Autotune vs hand-picked settings on examples/pytorch_synthetic_benchmark.py.

    python bench/autotune.py --np 2 [--no-cuda] [--model resnet50] [--batch-size 64]
                             [-- extra synthetic-benchmark args]

Runs the synthetic benchmark once per hand-picked setting (fusion threshold x wake
delay, response cache on) and once with HOROVOD_AUTOTUNE=1, whose run gets extra
warm-up batches so the search ends before the timed iterations. Prints img/s of
each, the setting autotune kept, and autotune's throughput relative to the best
hand-picked one (same machine, same run).
"""
import argparse
import csv
import os
import tempfile

from _launch import run_synthetic as run

MB = 1 << 20
SETTINGS = [  # (fusion threshold bytes, wake delay us)
    (0, 0), (1 * MB, 0), (8 * MB, 0), (64 * MB, 0), (8 * MB, 1000), (64 * MB, 2500),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--autotune-warmup-batches", type=int, default=150,
                   help="warm-up batches of the autotune run (the search happens there)")
    p.add_argument("extra", nargs="*", help="more synthetic-benchmark arguments (after --)")
    a = p.parse_args()
    base = ["--model", a.model, "--batch-size", str(a.batch_size), "--num-iters",
            str(a.num_iters), *(["--no-cuda"] if a.no_cuda else []), *a.extra]
    print(f"synthetic benchmark {' '.join(base)} on {a.np} ranks", flush=True)
    print(f"{'setting':<44} {'img/s':>10}", flush=True)
    hand = {}
    for fusion, wake in SETTINGS:
        label = f"fusion {fusion // MB} MB, wake delay {wake} us"
        hand[label] = run(a.np, base, {"HOROVOD_FUSION_THRESHOLD": str(fusion),
                                       "HOROVOD_WAKE_DELAY_US": str(wake)})
        print(f"{label:<44} {hand[label]:>10.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "autotune.csv")
        tuned = run(a.np, base + ["--num-warmup-batches", str(a.autotune_warmup_batches)],
                    {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": log})
        rows = list(csv.DictReader(open(log)))
    best_row = [r for r in rows if r["phase"] == "best"]
    kept = "search not finished" if not best_row else (
        f"fusion {int(best_row[0]['fusion_threshold_bytes']) // MB} MB, wake delay "
        f"{float(best_row[0]['wake_delay_us']):.0f} us, cache "
        f"{'on' if best_row[0]['cache_enabled'] == '1' else 'off'}")
    print(f"{'autotune (kept: ' + kept + ')':<44} {tuned:>10.1f}")
    best_label = max(hand, key=hand.get)
    print(f"autotune / best hand-picked ({best_label}): {tuned / hand[best_label]:.3f}; "
          f"samples scored: {sum(r['phase'] == 'sample' for r in rows)}")


if __name__ == "__main__":
    main()
