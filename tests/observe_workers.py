"""Worker functions for the timeline and autotune tests (run by tests.harness)."""
import json
import os
import random
import sys
import time

import torch

import horovod_torch as hvd


def timeline_run(kill: str = "0") -> None:
    """Fused allreduces, an allgather and a broadcast; optionally SIGKILL rank 0
    before shutdown so the timeline is left open."""
    hvd.init()
    ts = [torch.full((1000 + i,), float(hvd.rank() + 1)) for i in range(3)]
    handles = [hvd.allreduce_async(t, name=f"grad.{i}", op=hvd.Sum) for i, t in enumerate(ts)]
    for h in handles:
        assert torch.all(hvd.synchronize(h) == 3.0)
    hvd.allgather(torch.ones(2, 3), name="gathered")
    hvd.broadcast(torch.zeros(4), root_rank=0, name="bcast")
    for step in range(3):  # repeats are served by the response cache
        hvd.allreduce(torch.ones(10), name="repeat")
    hvd.barrier()
    if kill == "1":
        if hvd.rank() == 0:
            time.sleep(0.2)
            os.kill(os.getpid(), 9)
        time.sleep(2)  # a shutdown now would close rank 0's timeline first
    hvd.shutdown()


def timeline_training(steps: str = "6") -> None:
    """A small model trained with DistributedOptimizer: each step both ranks compute
    for 30 ms, and rank 1 for 20 ms more, so the coordinator waits for it."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(int(steps)):
        time.sleep(0.03 + (0.02 if hvd.rank() == 1 else 0.0))
        opt.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
    hvd.shutdown()


def timeline_dynamic(path: str) -> None:
    """HOROVOD_TIMELINE=DYNAMIC: only ops between start and stop are recorded."""
    hvd.init()
    hvd.allreduce(torch.ones(3), name="before")
    if hvd.rank() == 0:
        try:
            hvd.start_timeline("/nonexistent-dir/timeline.json")
            raise AssertionError("start_timeline accepted an unwritable path")
        except ValueError as e:
            assert "/nonexistent-dir/timeline.json" in str(e), e
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="during")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with open(path) as f:
            json.load(f)  # complete as soon as stop_timeline() returns
    hvd.allreduce(torch.ones(3), name="after")
    hvd.barrier()
    hvd.shutdown()


def autotune_run(steps: str) -> None:
    """Training-like steps (a burst of gradient allreduces) while autotune
    searches; every result is checked, ranks submit in different orders with
    random delays. Prints the final setting as JSON."""
    hvd.init()
    rng = random.Random(hvd.rank())
    sizes = [2000, 50_000, 300, 120_000, 7, 9000]
    for step in range(int(steps)):
        order = list(range(len(sizes)))
        rng.shuffle(order)
        handles = {}
        for i in order:
            handles[i] = hvd.allreduce_async(torch.full((sizes[i],), float(hvd.rank() + i)),
                                             name=f"g{i}", op=hvd.Sum)
            if rng.random() < 0.2:
                time.sleep(0.0005)
        expected = {i: float(sum(r + i for r in range(hvd.size()))) for i in handles}
        for i, h in handles.items():
            out = hvd.synchronize(h)
            assert torch.all(out == expected[i]), (step, i, out[:3])
    hvd.barrier()
    params = hvd._C.tuned_params()
    gathered = hvd.allgather_object(params)
    if hvd.rank() == 0:
        sys.stdout.write("PARAMS " + json.dumps(gathered) + "\n")
    hvd.shutdown()
