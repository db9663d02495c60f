"""DDP on the "hvd" backend that goes on after a worker dies, in the same processes.

    python examples/torch_distributed/ddp_survivors.py [--np 3] [--fail-rank 2]
        [--fail-step 5] [--steps 20]

Starts --np workers on this host (torch.multiprocessing), each training a small model
with DistributedDataParallel on dist.init_process_group("hvd"). At --fail-step the
worker of rank --fail-rank dies (os._exit). The others' pending collective fails with
torch.distributed.DistBackendError (within the engine's I/O timeout, never a hang);
they destroy the group, build a new one of the survivors (ranks renumbered, a new
store), restore the model and optimizer from their last checkpoint in memory, and
finish the steps. Under torchrun one would rather let torchrun restart the job; this
shows that the backend itself never strands a survivor.
"""
import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_torch.torch_distributed  # noqa: F401  (registers "hvd" where torch did not)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, a: argparse.Namespace, ports: list) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    dist.init_process_group("hvd", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                            world_size=a.np)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    checkpoint = None
    step = 0
    while step < a.steps:
        if rank == a.fail_rank and step == a.fail_step:
            print(f"rank {rank}: dying at step {step}", flush=True)
            os._exit(1)  # as a killed process: no shutdown, its sockets just close
        try:
            x = torch.randn(16, 8)
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            checkpoint = (step + 1, {k: v.clone() for k, v in model.state_dict().items()},
                          opt.state_dict())
            step += 1
        except (dist.DistBackendError, RuntimeError) as exc:  # backward() may wrap it
            print(f"rank {rank}: step {step} failed: {str(exc).splitlines()[0][:120]}",
                  flush=True)
            dist.destroy_process_group()
            # Survivors keep their order; the dead rank's successors move down by one.
            rank = rank - (rank > a.fail_rank)
            dist.init_process_group("hvd", init_method=f"tcp://127.0.0.1:{ports[1]}",
                                    rank=rank, world_size=a.np - 1)
            step, weights, opt_state = checkpoint
            model.load_state_dict(weights)
            ddp = DDP(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            opt.load_state_dict(opt_state)
            print(f"rank {rank}: rebuilt a group of {dist.get_world_size()} at step {step}",
                  flush=True)
    flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
    same = flat.clone()
    dist.broadcast(same, src=0)
    print(f"rank {rank}: finished {step} steps on {dist.get_world_size()} ranks; "
          f"parameters equal to rank 0's: {torch.equal(flat, same)}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=3)
    p.add_argument("--fail-rank", type=int, default=2)
    p.add_argument("--fail-step", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    ctx = mp.spawn(worker, args=(a, [free_port(), free_port()]), nprocs=a.np, join=False)
    for proc in ctx.processes:
        proc.join()
    codes = [proc.exitcode for i, proc in enumerate(ctx.processes) if i != a.fail_rank]
    raise SystemExit(max(codes))


if __name__ == "__main__":
    main()
