"""Training speed before and after a straggler's eviction, against a clean job of the
survivors' size, same machine, same run (CPU, elastic horovodrun, tests/elastic_train.py).

    python bench/straggler_evict.py [--steps 400] [--slow-s 0.1] [--step-s 0.02] [--rounds 2]

Job A: 3 one-slot "hosts" (localhost, 127.0.0.2, 127.0.0.3); the workers on 127.0.0.3
sleep --slow-s more per step; --straggler-policy evict --straggler-evict-after 2.
Job B: the 2 other hosts only, nobody slow. Rank 0 prints its step every 10 steps; the
rates are steps/s of job A while it had 3 workers, of job A after the eviction (from
its first full 10 steps at 2 workers on), and of job B. Jobs alternate.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(hosts, args, env, steps):
    with tempfile.TemporaryDirectory() as tmp:
        hosts_file = os.path.join(tmp, "hosts.txt")
        with open(hosts_file, "w") as f:
            f.write("\n".join(hosts) + "\n")
        discover = os.path.join(tmp, "discover.sh")
        with open(discover, "w") as f:
            f.write(f"#!/bin/sh\ncat {hosts_file}\n")
        os.chmod(discover, 0o755)
        full = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", STEP_LOG="1",
                    STEPS=str(steps), MARKER=os.path.join(tmp, "marker"), **env)
        cmd = [sys.executable, "-m", "horovod_torch.runner", "--host-discovery-script",
               discover, *args, sys.executable, os.path.join(REPO, "tests", "elastic_train.py")]
        out = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.stdout.write(out.stdout[-3000:] + out.stderr[-3000:])
        raise SystemExit("job failed")
    points = [(int(s), int(n), float(t)) for s, n, t in
              re.findall(r"STEP step=(\d+) size=(\d+) at=([\d.]+)", out.stdout)]
    return points, out.stdout + out.stderr


def rate(points):
    """Steps per second over a run of (step, size, at) points."""
    if len(points) < 2:
        return float("nan")
    return (points[-1][0] - points[0][0]) / (points[-1][2] - points[0][2])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--slow-s", type=float, default=0.1)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    env = {"STEP_SLEEP": str(a.step_s)}
    before, after, clean = [], [], []
    for _ in range(a.rounds):
        pts, out = run(["localhost:1", "127.0.0.2:1", "127.0.0.3:1"],
                       ["-np", "3", "--min-np", "2", "--max-np", "3", "--straggler-policy",
                        "evict", "--straggler-evict-after", "2"],
                       {**env, "SLOW_HOST": "127.0.0.3", "SLOW_S": str(a.slow_s)}, a.steps)
        evicted = re.search(r"evicting host .*", out)
        print(evicted.group(0) if evicted else "no eviction")
        three = [x for x in pts if x[1] == 3]
        two = [x for x in pts if x[1] == 2][1:]  # from the first full 10 steps at 2
        before.append(rate(three))
        after.append(rate(two))
        pts, _ = run(["localhost:1", "127.0.0.2:1"], ["-np", "2", "--min-np", "2"], env, a.steps)
        clean.append(rate(pts[1:]))
        print(f"round: with the straggler {before[-1]:.2f} steps/s, after its eviction "
              f"{after[-1]:.2f}, clean 2-worker job {clean[-1]:.2f}")
    b, af, c = (statistics.median(x) for x in (before, after, clean))
    print(f"median steps/s: with the straggler {b:.2f}, after the eviction {af:.2f}, clean "
          f"2-worker job {c:.2f}; after / clean {af / c:.3f}, after / before {af / b:.2f}")


if __name__ == "__main__":
    main()
