"""hvd.allreduce vs torch.distributed (gloo) all_reduce on CPU tensors: same
processes, same run, 4 KB to 64 MB. Prints a table of median times and speedups.

    python bench/allreduce_cpu.py --np 2 [--np 4] [--iters 20]

The script launches itself under horovodrun; each worker initialises both
horovod_torch and a gloo process group and alternates between them per size.
"""
import argparse
import os
import statistics
import sys
import time

from _launch import launch_self, size_str

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]




def worker(iters: int) -> None:
    import torch
    import torch.distributed as dist

    import horovod_torch as hvd
    hvd.init()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=hvd.rank(), world_size=hvd.size())
    torch.set_num_threads(1)
    rows = []
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        n_iter = max(5, min(iters, int(iters * (4 << 20) / nbytes)) if nbytes > 4 << 20 else iters)
        n_iter = iters if nbytes <= 1 << 20 else max(5, iters // 2)
        times = {"hvd": [], "gloo": []}
        for i in range(n_iter + 3):  # 3 warm-up rounds
            for lib in ("hvd", "gloo"):
                dist.barrier()
                start = time.perf_counter()
                if lib == "hvd":
                    hvd.allreduce_(t, name=f"bench.{nbytes}", op=hvd.Sum)
                else:
                    dist.all_reduce(t)
                elapsed = time.perf_counter() - start
                if i >= 3:
                    times[lib].append(elapsed)
        # Every rank's time counts: the op is done when the slowest rank is.
        med = {k: torch.tensor([statistics.median(v)], dtype=torch.float64)
               for k, v in times.items()}
        for v in med.values():
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        rows.append((nbytes, med["hvd"].item(), med["gloo"].item()))
    if hvd.rank() == 0:
        print(f"\nallreduce float32, {hvd.size()} ranks, median of per-op times "
              f"(torch {torch.__version__}, {os.cpu_count()} CPUs)")
        print(f"{'size':>8} {'hvd ms':>10} {'gloo ms':>10} {'speedup':>8} {'hvd GB/s':>9}")
        for nbytes, th, tg in rows:
            busbw = 2 * (hvd.size() - 1) / hvd.size() * nbytes / th / 1e9
            print(f"{size_str(nbytes):>8} {th * 1e3:10.3f} {tg * 1e3:10.3f} {tg / th:7.2f}x "
                  f"{busbw:9.2f}")
        sys.stdout.flush()
    dist.destroy_process_group()
    hvd.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, action="append", help="ranks (repeatable; default 2 and 4)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.iters)
        return
    for n in args.np or [2, 4]:
        rc = launch_self(__file__, n, ["--iters", str(args.iters)], {"OMP_NUM_THREADS": "1"})
        if rc != 0:
            sys.exit(rc)

if __name__ == "__main__":
    main()
