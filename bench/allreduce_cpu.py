"""hvd.allreduce vs torch.distributed (gloo) all_reduce on CPU tensors: same
processes, same run, 4 KB to 64 MB. Prints a table of median times and speedups.

    python bench/allreduce_cpu.py --np 2 [--np 4] [--iters 20] [--back-to-back K]
    python bench/allreduce_cpu.py --transport mpi --np 2
    python bench/allreduce_cpu.py --np 8 --back-to-back 5 --shm-vs-tcp 2

The script launches itself under horovodrun; each worker initialises both
horovod_torch and a gloo process group and alternates between them per size.
With --transport mpi it launches itself under mpirun and measures horovod_torch
twice in the same processes, over MPI (HOROVOD_CONTROLLER=mpi) and over its TCP
transport (HOROVOD_CONTROLLER=gloo), each alternating with gloo.

With --shm-vs-tcp R the same processes alternate R times between flat TCP
(HOROVOD_HIERARCHICAL_ALLREDUCE=0) and the default (shared memory within the host
above HOROVOD_SMALL_ALLREDUCE_BYTES), re-initialising horovod_torch in between, and
print TCP / shared-memory ratios: an A/B free of the drift between separate runs.

Each sample is timed from a barrier: one op (default), or K ops back to back
(--back-to-back K, the time divided by K), which leaves out the barrier's exit skew
between ranks, as bandwidth benchmarks do.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from _launch import REPO, free_port, launch_self, size_str

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]




def _measure(hvd, dist, torch, iters, reps=1):
    """[(bytes, hvd median s, gloo median s)], slowest rank's medians."""
    rows = []
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        n_iter = iters if nbytes <= 1 << 20 else max(5, iters // 2)
        times = {"hvd": [], "gloo": []}
        for i in range(n_iter + 3):  # 3 warm-up rounds
            for lib in ("hvd", "gloo"):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    if lib == "hvd":
                        hvd.allreduce_(t, name=f"bench.{nbytes}", op=hvd.Sum)
                    else:
                        dist.all_reduce(t)
                elapsed = (time.perf_counter() - start) / reps
                if i >= 3:
                    times[lib].append(elapsed)
        # Every rank's time counts: the op is done when the slowest rank is.
        med = {k: torch.tensor([statistics.median(v)], dtype=torch.float64)
               for k, v in times.items()}
        for v in med.values():
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        rows.append((nbytes, med["hvd"].item(), med["gloo"].item()))
    return rows


def _init(hvd, dist) -> None:
    """hvd.init(), and the gloo group the first time."""
    hvd.init()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                                rank=hvd.rank(), world_size=hvd.size())


def _shm_vs_tcp(hvd, dist, torch, iters, reps, rounds):
    """Alternates flat TCP and the default (shared memory) in the same processes."""
    runs = {"tcp": [], "shm": []}
    for _ in range(rounds):
        for kind, value in (("tcp", "0"), ("shm", "-1")):
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = value
            _init(hvd, dist)
            runs[kind].append(_measure(hvd, dist, torch, iters, reps))
            hvd.shutdown()
    if dist.get_rank() == 0:
        print(f"\nallreduce float32, {dist.get_world_size()} ranks, flat TCP vs shared memory, "
              f"{rounds} alternating rounds, median of per-op times of {reps} back to back "
              f"(torch {torch.__version__}, {os.cpu_count()} CPUs), ms")
        print(f"{'size':>8} {'TCP (rounds)':>24} {'shm (rounds)':>24} {'TCP/shm':>8} {'gloo':>14}")
        for i, nbytes in enumerate(SIZES):
            tcp = [r[i][1] * 1e3 for r in runs["tcp"]]
            shm = [r[i][1] * 1e3 for r in runs["shm"]]
            gloo = [r[i][2] * 1e3 for kind in runs for r in runs[kind]]
            print(f"{size_str(nbytes):>8} {' / '.join(f'{x:.3f}' for x in tcp):>24} "
                  f"{' / '.join(f'{x:.3f}' for x in shm):>24} "
                  f"{statistics.mean(tcp) / statistics.mean(shm):7.2f}x "
                  f"{min(gloo):6.3f}-{max(gloo):.3f}")
        sys.stdout.flush()
    dist.destroy_process_group()


def worker(iters: int, transport: str, reps: int = 1, shm_vs_tcp: int = 0) -> None:
    import torch
    import torch.distributed as dist

    import horovod_torch as hvd
    torch.set_num_threads(1)
    if shm_vs_tcp > 0:
        _shm_vs_tcp(hvd, dist, torch, iters, reps, shm_vs_tcp)
        return
    if transport == "tcp":
        _init(hvd, dist)
        rows = _measure(hvd, dist, torch, iters, reps)
        if hvd.rank() == 0:
            how = "per-op times" if reps == 1 else f"per-op times of {reps} back to back"
            print(f"\nallreduce float32, {hvd.size()} ranks, median of {how} "
                  f"(torch {torch.__version__}, {os.cpu_count()} CPUs)")
            print(f"{'size':>8} {'hvd ms':>10} {'gloo ms':>10} {'speedup':>8} {'hvd GB/s':>9}")
            for nbytes, th, tg in rows:
                busbw = 2 * (hvd.size() - 1) / hvd.size() * nbytes / th / 1e9
                print(f"{size_str(nbytes):>8} {th * 1e3:10.3f} {tg * 1e3:10.3f} {tg / th:7.2f}x "
                      f"{busbw:9.2f}")
            sys.stdout.flush()
        dist.destroy_process_group()
        hvd.shutdown()
        return
    # Under mpirun: the MPI controller, then the TCP transport, in the same processes.
    results = {}
    for controller in ("mpi", "gloo"):
        os.environ["HOROVOD_CONTROLLER"] = controller
        _init(hvd, dist)
        assert hvd.mpi_enabled() == (controller == "mpi")
        results[controller] = _measure(hvd, dist, torch, iters, reps)
        hvd.shutdown()
    if dist.get_rank() == 0:
        print(f"\nallreduce float32, {dist.get_world_size()} ranks under mpirun, median of "
              f"per-op times (torch {torch.__version__}, {os.cpu_count()} CPUs)")
        print(f"{'size':>8} {'hvd-mpi ms':>11} {'hvd-tcp ms':>11} {'gloo ms':>9} "
              f"{'tcp/mpi':>8} {'gloo/mpi':>9}")
        for (nbytes, tm, g1), (_, tt, g2) in zip(results["mpi"], results["gloo"]):
            tg = min(g1, g2)
            print(f"{size_str(nbytes):>8} {tm * 1e3:11.3f} {tt * 1e3:11.3f} {tg * 1e3:9.3f} "
                  f"{tt / tm:7.2f}x {tg / tm:8.2f}x")
        sys.stdout.flush()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, action="append", help="ranks (repeatable; default 2 and 4)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--back-to-back", type=int, default=1, metavar="K",
                   help="time K ops in a row per sample (default 1)")
    p.add_argument("--transport", choices=("tcp", "mpi"), default="tcp",
                   help="mpi: run under mpirun and compare MPI, TCP and gloo")
    p.add_argument("--shm-vs-tcp", type=int, default=0, metavar="R",
                   help="alternate R times between flat TCP and shared memory (TCP only)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.shm_vs_tcp and args.transport != "tcp":
        p.error("--shm-vs-tcp compares the TCP transport with shared memory; drop --transport mpi")
    if args.worker:
        worker(args.iters, args.transport, args.back_to_back, args.shm_vs_tcp)
        return
    for n in args.np or [2, 4]:
        if args.transport == "tcp":
            rc = launch_self(__file__, n, ["--iters", str(args.iters), "--back-to-back",
                                           str(args.back_to_back), "--shm-vs-tcp",
                                           str(args.shm_vs_tcp)], {"OMP_NUM_THREADS": "1"})
        else:
            env = dict(os.environ, BENCH_PORT=str(free_port()), OMP_NUM_THREADS="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
            rc = subprocess.call(
                ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
                 "--mca", "btl", "self,vader,tcp", "-x", "BENCH_PORT", "-x", "OMP_NUM_THREADS",
                 "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
                 sys.executable, os.path.abspath(__file__), "--worker", "--transport", "mpi",
                 "--iters", str(args.iters), "--back-to-back", str(args.back_to_back)], env=env)
        if rc != 0:
            sys.exit(rc)


if __name__ == "__main__":
    main()
