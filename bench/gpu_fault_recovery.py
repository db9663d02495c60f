"""Recovery of an elastic GPU job from a worker that dies or stops inside the step's
NCCL allreduces (#32 item 3): the time from the failure to the survivors' next
completed step.

    python bench/gpu_fault_recovery.py [--np 2] [--how kill,stop] [--repeat 1]
                                       [--big-mb 256] [--tcp-timeout 10]

Each run is `horovodrun` elastic (`--min-np 1 --max-np N`, localhost:N, a blacklist
cooldown of 600 s so that the dead slot is not refilled while it is measured) of
tests/elastic_train.py on CUDA: a linear model plus a --big-mb parameter, momentum
SGD through hvd.DistributedOptimizer, state.commit() every step. Before step 10 the
last rank keeps its GPU busy (a minute-long kernel), runs the step, so that the
others' kernels of its allreduces wait for its share, and 2 s later kills itself
(SIGKILL) or stops (SIGSTOP). The time of the failure is what it wrote to its marker
file just before; the figure is the survivors' RECOVERY line (rank 0, after its
first completed step in the new generation). What it is made of:

- kill: the survivors' control plane sees the closed sockets at once, fails the
  engine and aborts the NCCL communicators (their kernels end); the next commit
  raises HorovodInternalError, the last commit is restored, the driver forms a new
  generation without the dead worker;
- stop: nothing closes. The survivors find the silent rank after HOROVOD_TCP_TIMEOUT
  (--tcp-timeout; default 60 s in a real job), report it, and the driver kills the
  worker that never left the failed generation HUNG_GRACE_S (10 s) after the report.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(np_: int, how: str, big_mb: int, tcp_timeout: float, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        discover = os.path.join(tmp, "discover.sh")
        with open(discover, "w") as f:
            f.write(f"#!/bin/sh\necho localhost:{np_}\n")
        os.chmod(discover, 0o755)
        env = dict(os.environ, PYTHONPATH=REPO, MARKER=os.path.join(tmp, "killed"),
                   KILL_RANK=str(np_ - 1), KILL_STEP="10", KILL_HOW=how, KILL_INSIDE="1",
                   DEVICE="cuda", BIG_MB=str(big_mb), STEPS="15", STEP_SLEEP="0",
                   HOROVOD_TCP_TIMEOUT=str(tcp_timeout), NCCL_NVLS_ENABLE="0",
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "horovod_torch.runner", "--host-discovery-script",
               discover, "-np", str(np_), "--min-np", "1", "--max-np", str(np_),
               "--blacklist-cooldown-range", "600", "600", sys.executable,
               os.path.join(REPO, "tests", "elastic_train.py")]
        t0 = time.monotonic()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                             cwd=REPO)
        text = out.stdout + out.stderr
        recovery = re.findall(r"RECOVERY rank=0 seconds=([\d.]+)", text)
        finals = re.findall(r"FINAL .*same=(\S+)", text)
        return {"rc": out.returncode, "recovery": float(recovery[0]) if recovery else None,
                "same": finals, "wall": time.monotonic() - t0,
                "tail": "" if recovery else text[-3000:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--how", default="kill,stop")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--big-mb", type=int, default=256)
    p.add_argument("--tcp-timeout", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=240.0)
    a = p.parse_args()
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"{a.np} x {gpu}, torch {torch.__version__}, NCCL "
          f"{'.'.join(map(str, torch.cuda.nccl.version()))}, HOROVOD_TCP_TIMEOUT="
          f"{a.tcp_timeout:g}, {a.big_mb} MB parameter", flush=True)
    for how in a.how.split(","):
        for i in range(a.repeat):
            r = run_once(a.np, how, a.big_mb, a.tcp_timeout, a.timeout)
            print(f"| {how} | {a.np} GPUs | run {i + 1} | exit {r['rc']} | recovery "
                  f"{r['recovery']} s | final states equal: {r['same']} | wall "
                  f"{r['wall']:.1f} s |", flush=True)
            if r["tail"]:
                print(r["tail"], flush=True)


if __name__ == "__main__":
    main()
