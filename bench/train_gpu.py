"""Training throughput: hvd.DistributedOptimizer vs DistributedDataParallel (NCCL) on
the same GPUs, same processes, same run. Synthetic data, img/s (or tokens/s).

    python bench/train_gpu.py [--model resnet50] [--batch-size 64] [--np N]

`--fp16-allreduce` adds hvd with Compression.fp16 and DDP with fp16_compress_hook,
`--python-hooks` hvd with its gradient hooks in Python, `--no-comm` "none": the same
model and optimizer without any communication, each GPU on its own. Its rate is the
limit, so each contender's scaling efficiency (its rate over none's, per GPU) is printed
too: what N independent GPUs would do, measured beside the others in the same run.
`--compile` puts every contender's model under `torch.compile` (DDP's as
`torch.compile(DistributedDataParallel(model))`, as torch documents it). Every
contender trains the same initial weights on the same fixed batch for the same number
of steps, so the mean over ranks of each one's last loss is printed too (compression
shows there).

Models: any torchvision model name (fp32), or `transformer` (~350M parameters, bf16
autocast). The contenders live in the same processes and take turns block by block
(the first of each round rotating), so that drift of a shared machine falls on all of
them alike. Prints per-GPU and total throughput of each (median over blocks), every
block, and the ratios.
"""
import argparse
import os
import statistics
import sys
import time

from _launch import launch_self



def _init():
    """hvd, and torch.distributed on NCCL (the peer's rendezvous at BENCH_PORT), in this
    worker: one GPU per local rank, cuDNN autotuning on. Returns the rank's device."""
    import torch
    import torch.distributed as dist

    import horovod_torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=hvd.rank(), world_size=hvd.size(), device_id=dev)
    torch.backends.cudnn.benchmark = True
    return dev


def _build(name, dev, layers=24):
    import torch.nn as nn
    if name == "transformer":
        # No dropout: the contenders draw from one random stream in turns, so with it
        # their losses would differ by the masks, not by how they communicate.
        layer = nn.TransformerEncoderLayer(d_model=1024, nhead=16, dim_feedforward=4096,
                                           dropout=0.0, batch_first=True, norm_first=True)
        model = nn.Sequential(nn.Embedding(32000, 1024), nn.TransformerEncoder(layer, layers),
                              nn.Linear(1024, 32000))
        return model.to(dev)
    import torchvision.models as models
    return getattr(models, name)(num_classes=1000).to(dev)


def _sgd(name, model):
    """The benchmarks' optimizer: SGD with momentum. The transformer gets lr 1e-3: at
    0.01 its loss went to NaN within 20 steps on an H200 (bf16 autocast), and every
    contender then timed arithmetic on NaNs."""
    import torch
    lr = 1e-3 if name == "transformer" else 0.01
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _batch(name, batch_size, dev):
    """Synthetic inputs and targets for one step of model `name`."""
    import torch
    if name == "transformer":
        return (torch.randint(0, 32000, (batch_size, 512), device=dev),
                torch.randint(0, 32000, (batch_size, 512), device=dev))
    return (torch.randn(batch_size, 3, 224, 224, device=dev),
            torch.randint(0, 1000, (batch_size,), device=dev))


def _step(net, opt, data, target, is_lm, mark=None):
    """One training step (the transformer under bf16 autocast); returns its loss. With
    `mark`, calls it at each phase's start: forward, backward, opt.step()."""
    import torch
    import torch.nn.functional as F
    if mark is not None:
        mark()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=is_lm):
        out = net(data)
        if is_lm:
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        else:
            loss = F.cross_entropy(out, target)
    if mark is not None:
        mark()
    loss.backward()
    if mark is not None:
        mark()
    opt.step()
    return loss.detach()


def _contender(lib, name, dev, compile=False):
    """Model `name` and its SGD, the same initial weights for every contender, set up
    for `lib`: none (no communication), hvd, hvd-fp16, hvd-py (hooks in Python), ddp,
    ddp-fp16. Returns (the module to call, the optimizer)."""
    import torch

    import horovod_torch as hvd
    torch.manual_seed(0)
    model = _build(name, dev)
    if compile and lib != "ddp" and not lib.startswith("ddp-"):
        model = torch.compile(model)
    opt = _sgd(name, model)
    if lib == "none":
        return model, opt
    if lib.startswith("hvd"):
        comp = hvd.Compression.fp16 if lib == "hvd-fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=comp)
        if lib == "hvd-py" and opt._native is not None:
            opt._native = None  # detaches the C++ hooks
            opt._register_hooks(native=False)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, opt
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    if lib == "ddp-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return (torch.compile(ddp) if compile else ddp), opt


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import horovod_torch as hvd
    dev = _init()
    is_lm = args.model == "transformer"
    data, target = _batch(args.model, args.batch_size, dev)

    last_loss = {}

    def step(net, opt):
        last_loss[id(net)] = _step(net, opt, data, target, is_lm)

    # Every contender lives in the process at once and they take turns block by
    # block, the first of each round rotating, so that drift of the machine (clocks,
    # other tenants) falls on all of them alike.
    libs = ["hvd", "ddp"] + (["hvd-fp16", "ddp-fp16"] if args.fp16_allreduce else [])
    libs += ["hvd-py"] if args.python_hooks else []
    libs += ["none"] if args.no_comm else []
    setups = {lib: _contender(lib, args.model, dev, args.compile) for lib in libs}
    for lib in libs:
        for _ in range(args.warmup):
            step(*setups[lib])
    torch.cuda.synchronize()
    rates = {lib: [] for lib in libs}
    for block in range(args.iters):
        for lib in libs[block % len(libs):] + libs[:block % len(libs)]:
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(*setups[lib])
            torch.cuda.synchronize()
            rates[lib].append(args.batch_size * args.steps / (time.perf_counter() - t0))
    rate = {k: torch.tensor([statistics.median(v)], device=dev) for k, v in rates.items()}
    for v in rate.values():
        dist.all_reduce(v, op=dist.ReduceOp.MIN)  # the slowest rank sets the pace
    loss = {lib: last_loss[id(setups[lib][0])].float().reshape(1) for lib in libs}
    for v in loss.values():
        dist.all_reduce(v)
    if hvd.rank() == 0:
        unit = "seq/s" if is_lm else "img/s"
        n = hvd.size()
        print(f"\n{args.model} batch {args.batch_size}/GPU on {n} x "
              f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__}), median of "
              f"{args.iters} interleaved blocks of {args.steps} steps"
              f"{', under torch.compile' if args.compile else ''}")
        print(f"{'':9} {unit + '/GPU':>12} {'total':>10} {'last loss':>10}  "
              f"blocks ({unit}/GPU, this rank)")
        for lib in libs:
            r = rate[lib].item()
            blocks = " ".join(f"{x:.0f}" for x in rates[lib])
            print(f"{lib:9} {r:12.1f} {r * n:10.1f} {loss[lib].item() / n:10.4f}  {blocks}")
        for lib in libs:
            if lib not in ("ddp", "none"):
                print(f"{lib}/ddp throughput ratio: {rate[lib].item() / rate['ddp'].item():.3f}")
        for lib in libs:
            if lib != "none" and "none" in libs:
                print(f"{lib} scaling efficiency: {rate[lib].item() / rate['none'].item():.3f}")
        if "ddp-fp16" in libs:
            print(f"hvd-fp16/ddp-fp16 throughput ratio: "
                  f"{rate['hvd-fp16'].item() / rate['ddp-fp16'].item():.3f}")
        sys.stdout.flush()
    dist.destroy_process_group()
    hvd.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--np", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fp16-allreduce", action="store_true",
                   help="also hvd with Compression.fp16 and DDP with its fp16_compress_hook")
    p.add_argument("--python-hooks", action="store_true",
                   help="also hvd with its gradient hooks in Python (HOROVOD_NATIVE_GRAD_HOOKS=0)")
    p.add_argument("--no-comm", action="store_true",
                   help="also the model without communication (scaling efficiency)")
    p.add_argument("--compile", action="store_true",
                   help="every contender's model under torch.compile")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    import torch
    n = args.np or torch.cuda.device_count()
    worker_args = ["--model", args.model, "--batch-size", str(args.batch_size),
                   "--warmup", str(args.warmup), "--iters", str(args.iters),
                   "--steps", str(args.steps)]
    worker_args += ["--fp16-allreduce"] if args.fp16_allreduce else []
    worker_args += ["--python-hooks"] if args.python_hooks else []
    worker_args += ["--no-comm"] if args.no_comm else []
    worker_args += ["--compile"] if args.compile else []
    sys.exit(launch_self(__file__, n, worker_args))

if __name__ == "__main__":
    main()
