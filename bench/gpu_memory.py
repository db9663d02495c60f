"""Extra GPU memory per process: hvd.DistributedOptimizer vs DistributedDataParallel.

    python bench/gpu_memory.py [--model resnet50] [--batch-size 32] [--np N]

Each contender runs in its own launch (its own processes), so that none sees the
others' buffers or communicators. A worker first trains the model for a few steps
with no communication at all (the baseline), then the same model and data wrapped by
the contender, for as many steps. Extra memory over the baseline, per process:

- allocator peak: the growth of torch.cuda.max_memory_allocated() (what is taken
  through PyTorch's caching allocator: hvd's fusion buffer and casts, DDP's buckets);
- device: the growth of the device memory in use (cudaMemGetInfo) from the end of
  the baseline to the end of the run. It adds NCCL's own buffers and what the
  caching allocator keeps.

The table shows the largest figure over the ranks, and each contender against DDP
with its defaults.
"""
import argparse
import json
import os
import sys
import tempfile

from _launch import launch_self
from train_gpu import _batch, _build, _sgd, _step

CONTENDERS = ["hvd", "hvd-fp16", "ddp", "ddp-bucket-view"]
MB = 1 << 20


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import horovod_torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    is_lm = args.model == "transformer"
    data, target = _batch(args.model, args.batch_size, dev)
    torch.manual_seed(0)
    model = _build(args.model, dev)
    opt = _sgd(args.model, model)

    def train(net, opt):
        for _ in range(args.steps):
            _step(net, opt, data, target, is_lm)
        torch.cuda.synchronize()

    def used():
        free, total = torch.cuda.mem_get_info(dev)
        return total - free

    train(model, opt)
    base_peak, base_used = torch.cuda.max_memory_allocated(dev), used()
    torch.cuda.reset_peak_memory_stats(dev)
    c = args.contender
    if c.startswith("hvd"):
        comp = hvd.Compression.fp16 if c == "hvd-fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        net = model
    else:
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
            rank=hvd.rank(), world_size=hvd.size(), device_id=dev)
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[dev.index], gradient_as_bucket_view=c == "ddp-bucket-view")
    train(net, opt)
    me = {"peak": torch.cuda.max_memory_allocated(dev) - base_peak, "used": used() - base_used,
          "base_peak": base_peak, "base_used": base_used}
    everyone = hvd.allgather_object(me, name="gpu_memory.result")
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": everyone, "device": torch.cuda.get_device_name(dev),
                       "torch": torch.__version__,
                       "params_mb": sum(p.numel() * p.element_size()
                                        for p in model.parameters()) / MB}, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    hvd.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--np", type=int, default=0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    import torch
    n = args.np or torch.cuda.device_count()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in CONTENDERS:
            out = os.path.join(tmp, c + ".json")
            rc = launch_self(__file__, n, ["--model", args.model, "--batch-size",
                                           str(args.batch_size), "--steps", str(args.steps),
                                           "--contender", c, "--out", out])
            if rc != 0:
                sys.exit(f"the {c} run failed (exit code {rc})")
            with open(out) as f:
                results[c] = json.load(f)
    first = results[CONTENDERS[0]]
    print(f"\n{args.model} batch {args.batch_size}/GPU, {n} x {first['device']} (torch "
          f"{first['torch']}), parameters {first['params_mb']:.0f} MB; baseline without "
          f"communication: allocator peak {first['ranks'][0]['base_peak'] / MB:.0f} MB, "
          f"device in use {first['ranks'][0]['base_used'] / MB:.0f} MB (rank 0)")
    print(f"{'extra per process':17} {'allocator peak MB':>18} {'device MB':>10} "
          f"{'peak vs ddp':>12} {'device vs ddp':>14}")
    worst = {c: {k: max(r[k] for r in results[c]["ranks"]) / MB for k in ("peak", "used")}
             for c in CONTENDERS}
    ddp = worst["ddp"]
    for c in CONTENDERS:
        w = worst[c]
        print(f"{c:17} {w['peak']:18.1f} {w['used']:10.1f} "
              f"{w['peak'] / max(ddp['peak'], 1e-9):11.2f}x "
              f"{w['used'] / max(ddp['used'], 1e-9):13.2f}x")


if __name__ == "__main__":
    main()
