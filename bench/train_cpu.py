"""Training speed on CPU: hvd.DistributedOptimizer vs torch DistributedDataParallel
(gloo), same processes, same run, same math. Prints median steps/s of each and the
ratio hvd/DDP, then checks that every rank ended with identical parameters.

    python bench/train_cpu.py --np 2 [--steps 60] [--batch-size 32] [--model cnn|mlp]

The script launches itself under ``python -m horovod_torch.runner``; each worker
initialises horovod_torch and a gloo process group and builds two copies of the same
model (same seed, so the same initial weights): one trained with
``hvd.DistributedOptimizer(SGD)``, one wrapped in ``DistributedDataParallel`` with the
same SGD. Both see the same per-rank synthetic MNIST-shaped batches in the same order.
Training alternates between them in blocks of --block steps (which one goes first
alternates too); a block's time is that of the slowest rank.
"""
import argparse
import copy
import os
import socket
import statistics
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_model(kind: str):
    import torch.nn as nn
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(),
                             nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    # The CNN of PyTorch's MNIST example, without dropout (dropout would draw random
    # numbers, and the two models train interleaved, so they would differ).
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_torch as hvd
    hvd.init()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=hvd.rank(), world_size=hvd.size())
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()

    # Same initial weights for both models, on every rank.
    torch.manual_seed(1234)
    base = _make_model(args.model)
    model_h = copy.deepcopy(base)
    model_d = copy.deepcopy(base)

    opt_h = torch.optim.SGD(model_h.parameters(), lr=args.lr, momentum=0.9)
    opt_h = hvd.DistributedOptimizer(opt_h, named_parameters=model_h.named_parameters())
    hvd.broadcast_parameters(model_h.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt_h, root_rank=0)

    ddp = DDP(model_d)  # broadcasts rank 0's parameters and buffers
    opt_d = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    # Per-rank synthetic data (different on every rank, so averaging matters): a pool
    # of batches that both models step through in the same order.
    gen = torch.Generator().manual_seed(1000 + rank)
    pool = [(torch.randn(args.batch_size, 1, 28, 28, generator=gen),
             torch.randint(0, 10, (args.batch_size,), generator=gen)) for _ in range(16)]

    def step_h(i):
        x, y = pool[i % len(pool)]
        opt_h.zero_grad()
        F.cross_entropy(model_h(x), y).backward()
        opt_h.step()

    def step_d(i):
        x, y = pool[i % len(pool)]
        opt_d.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt_d.step()

    steps = {"hvd": step_h, "ddp": step_d}
    counter = {"hvd": 0, "ddp": 0}

    def run(lib, n):
        for _ in range(n):
            steps[lib](counter[lib])
            counter[lib] += 1

    for lib in ("hvd", "ddp"):  # warm-up (trains both equally, so the math stays equal)
        run(lib, args.warmup)

    nblocks = max(1, -(-args.steps // args.block))
    times = {"hvd": [], "ddp": []}
    for b in range(nblocks):
        n = min(args.block, args.steps - b * args.block)
        order = ("hvd", "ddp") if b % 2 == 0 else ("ddp", "hvd")
        for lib in order:
            dist.barrier()
            start = time.perf_counter()
            run(lib, n)
            times[lib].append((time.perf_counter() - start, n))

    # A block takes as long as its slowest rank.
    rates = {}
    for lib, blocks in times.items():
        t = torch.tensor([s for s, _ in blocks], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rates[lib] = [n / s for s, (_, n) in zip(t.tolist(), blocks)]

    # Parameter checks: each model identical on every rank; and hvd vs DDP.
    def flat(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    fh, fd = flat(model_h), flat(model_d)
    gathered_h = [torch.empty_like(fh) for _ in range(size)]
    gathered_d = [torch.empty_like(fd) for _ in range(size)]
    dist.all_gather(gathered_h, fh)
    dist.all_gather(gathered_d, fd)
    same_h = all(torch.equal(g, gathered_h[0]) for g in gathered_h)
    same_d = all(torch.equal(g, gathered_d[0]) for g in gathered_d)
    diff = (fh - fd).abs().max().item()
    moved = (fh - flat(base)).abs().max().item()
    diffs = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)

    if rank == 0:
        med_h, med_d = statistics.median(rates["hvd"]), statistics.median(rates["ddp"])
        nparams = fh.numel()
        print(f"\ntraining {args.model} ({nparams / 1e6:.2f}M params), SGD, {size} ranks, "
              f"batch {args.batch_size}/rank, {args.steps} measured steps each "
              f"(+{args.warmup} warm-up, blocks of {args.block}), 1 thread/rank "
              f"(torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f})")
        print(f"{'':>6} {'median steps/s':>15} {'ms/step':>9} {'min':>7} {'max':>7}")
        for lib, med in (("hvd", med_h), ("DDP", med_d)):
            r = rates[lib.lower()]
            print(f"{lib:>6} {med:15.2f} {1e3 / med:9.1f} {min(r):7.2f} {max(r):7.2f}")
        print(f"ratio hvd/DDP (steps/s): {med_h / med_d:.3f}")
        print(f"parameters identical across ranks: hvd {'yes' if same_h else 'NO'}, "
              f"DDP {'yes' if same_d else 'NO'}; hvd vs DDP max |diff| = {diffs.item():.3g} "
              f"(weights moved by up to {moved:.3g})")
        sys.stdout.flush()
    ok = torch.tensor([int(same_h and same_d)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    hvd.shutdown()
    if not ok.item():
        sys.exit(3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=60, help="measured steps per model")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--block", type=int, default=10, help="steps per measurement block")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per model")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 1 or args.block < 1 or args.warmup < 0 or args.np < 1:
        p.error("--steps and --block must be >= 1, --warmup >= 0, --np >= 1")
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, BENCH_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", str(args.np),
           "--disable-prefix", sys.executable, os.path.abspath(__file__), "--worker",
           "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--model", args.model, "--block", str(args.block), "--warmup", str(args.warmup),
           "--lr", str(args.lr)]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
