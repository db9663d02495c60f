"""hvd.allreduce vs torch.distributed (NCCL) all_reduce on CUDA tensors: same
processes, same GPUs, same run. Prints median time per op, bus bandwidth and the ratio
torch/hvd of the times (above 1: hvd is faster; the bus bandwidth ratio).

    python bench/allreduce_gpu.py [--np N] [--iters 20] [--max-mb 1024] [--op average]

Launches itself under horovodrun with one process per GPU (default: all GPUs).
"""
import argparse
import os
import statistics
import sys
import time

from _launch import launch_self, size_str

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]




def worker(iters: int, max_mb: int, op: str) -> None:
    import torch
    import torch.distributed as dist

    import horovod_torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=hvd.rank(), world_size=hvd.size(), device_id=dev)
    hvd_op, torch_op = ((hvd.Average, dist.ReduceOp.AVG) if op == "average"
                        else (hvd.Sum, dist.ReduceOp.SUM))
    rows = []
    for nbytes in [s for s in SIZES if s <= max_mb << 20]:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        times = {"hvd": [], "nccl": []}
        for rep in range(6):  # blocks alternate between the two; block 0 warms up
            for lib in ("hvd", "nccl"):
                dist.barrier()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(iters):
                    if lib == "hvd":
                        hvd.allreduce_(t, name=f"bench.{nbytes}", op=hvd_op)
                    else:
                        dist.all_reduce(t, op=torch_op)
                torch.cuda.synchronize()
                if rep > 0:
                    times[lib].append((time.perf_counter() - start) / iters)
        med = {k: torch.tensor([statistics.median(v)], dtype=torch.float64, device=dev)
               for k, v in times.items()}
        for v in med.values():
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        rows.append((nbytes, med["hvd"].item(), med["nccl"].item()))
    if hvd.rank() == 0:
        print(f"\nallreduce ({op}) float32 on {hvd.size()} x {torch.cuda.get_device_name(dev)}, "
              f"median per-op time (torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}, hvd NCCL code "
              f"{hvd.nccl_built()})")
        print(f"{'size':>8} {'hvd us':>10} {'torch us':>10} {'torch/hvd':>9} "
              f"{'hvd busbw GB/s':>15}")
        n = hvd.size()
        for nbytes, th, tt in rows:
            busbw = 2 * (n - 1) / n * nbytes / th / 1e9
            print(f"{size_str(nbytes):>8} {th * 1e6:10.1f} {tt * 1e6:10.1f} {tt / th:8.2f}x "
                  f"{busbw:15.1f}")
        sys.stdout.flush()
    dist.destroy_process_group()
    hvd.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=0, help="processes (default: one per GPU)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-mb", type=int, default=1024, help="largest size in MB (default 1024)")
    p.add_argument("--op", choices=["sum", "average"], default="sum")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.iters, args.max_mb, args.op)
        return
    import torch
    n = args.np or torch.cuda.device_count()
    sys.exit(launch_self(__file__, n, ["--iters", str(args.iters), "--max-mb", str(args.max_mb),
                                          "--op", args.op]))

if __name__ == "__main__":
    main()
