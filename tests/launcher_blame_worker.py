"""A worker (run under horovodrun) of which one rank dies after a first allreduce.

FAIL_RANK (default 1) dies after the first allreduce: FAIL_MODE=exit (the default)
does os._exit(FAIL_CODE) (default 17), FAIL_MODE=kill SIGKILLs itself. With
FAIL_DELAY it dies that many seconds later, from a thread, while the others are in
the middle of allreduces of NUMEL floats (default 4, raise it to keep the TCP
transfers busy). The other ranks keep allreducing until horovod fails them (the
uncaught HorovodInternalError ends them with status 1) or ROUNDS rounds are done.
Each rank first prints ``PID rank=R pid=P``."""
import os
import signal
import sys
import threading
import time

import torch

import horovod.torch as hvd

hvd.init()
sys.stdout.write(f"PID rank={hvd.rank()} pid={os.getpid()}\n")
sys.stdout.flush()
hvd.allreduce(torch.ones(4), name="first")


def die() -> None:
    time.sleep(float(os.environ.get("FAIL_DELAY", "0")))
    sys.stdout.write(f"rank {hvd.rank()} dies now\n")
    sys.stdout.flush()
    if os.environ.get("FAIL_MODE", "exit") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(int(os.environ.get("FAIL_CODE", "17")))


if hvd.rank() == int(os.environ.get("FAIL_RANK", "1")):
    if os.environ.get("FAIL_DELAY"):
        threading.Thread(target=die, daemon=True).start()
    else:
        die()
tensor = torch.ones(int(os.environ.get("NUMEL", "4")))
for i in range(int(os.environ.get("ROUNDS", "3000"))):
    hvd.allreduce(tensor, name=f"round{i}")
    if tensor.numel() < 1000:
        time.sleep(0.01)
print("survived", flush=True)
