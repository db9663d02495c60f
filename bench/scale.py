"""Scale benchmark on one host's CPUs: hvd.allreduce vs torch.distributed (gloo) at
many ranks. Prints, per rank count, init time, allreduce latency and bandwidth with
the ratio gloo/hvd, and per-process file descriptors, threads and peak RSS; then a
summary table over all rank counts.

    python bench/scale.py --np 8 --np 32 --np 64 --np 128 [--sizes 4K,64K,1M,16M]
                          [--iters 20] [--timeout 600] [--step-timeout 180] [--json PATH]

The script launches itself under horovodrun once per rank count, with
OMP_NUM_THREADS=1 (and torch.set_num_threads(1) in the workers). Each worker:

1. imports torch and horovod_torch, then times ``hvd.init()`` and, after one 4 KB
   hvd.allreduce, counts its open file descriptors and threads;
2. times ``dist.init_process_group("gloo", init_method="tcp://127.0.0.1:BENCH_PORT")``;
3. per size, after 3 warm-up rounds, alternates hvd.allreduce_ and dist.all_reduce
   on a float32 tensor, each op after a barrier of its own library, timing every op; then runs
   each library's ops back to back ("b2b": total time / ops, no barrier between
   ops, so no barrier exit skew in it).

Ranks start init at different times (128 processes importing torch at once take a
while), so "init s" is the time from the last rank's call to the last rank's return
(wall clocks of one host agree); the longest single call, which also waits for late
ranks, is in the JSON. Latency is the median of the slowest rank, bandwidth is
algorithm bandwidth (bytes / latency).

A rank count that does not finish within --timeout seconds is stopped (horovodrun
and all its workers) and reported as failed; a worker step (init, one op) that takes
longer than --step-timeout prints its stack and ends the job. The next count runs
either way.
"""
import argparse
import ctypes
import faulthandler
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

from _launch import REPO, free_port, size_str

WARMUP = 3
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_sizes(text: str) -> List[int]:
    """"4K,64K,1M,16M" -> bytes; each size a positive multiple of 4 (float32)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().upper().removesuffix("B")
        unit = item[-1:] if item[-1:] in UNITS else ""
        try:
            n = int(item[:len(item) - len(unit)]) * UNITS[unit]
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad size {item!r}: use e.g. 4K, 1M") from None
        if n <= 0 or n % 4:
            raise argparse.ArgumentTypeError(f"size {item!r} is not a positive multiple of 4 B")
        sizes.append(n)
    return sizes


# ----------------------------------------------------------------- worker side

class Watchdog:
    """Ends this worker when one step outlives timeout_s, so a hang becomes an error.

    A daemon thread prints the step and every thread's stack and exits with 3
    (horovodrun then stops the other ranks). faulthandler, armed 30 s later, does
    the same without the step's name if a C++ call holds the GIL.
    """

    def __init__(self, timeout_s: float, rank: int) -> None:
        self._timeout_s = timeout_s
        self._rank = rank
        self._step = "importing torch and horovod_torch"
        self._deadline = time.monotonic() + timeout_s
        threading.Thread(target=self._watch, name="bench-watchdog", daemon=True).start()

    def arm(self, step: str) -> None:
        """Starts the clock for `step`."""
        self._step = step
        self._deadline = time.monotonic() + self._timeout_s
        faulthandler.dump_traceback_later(self._timeout_s + 30, exit=True)

    def stop(self) -> None:
        self._deadline = float("inf")
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        while time.monotonic() < self._deadline:
            time.sleep(1.0)
        sys.stderr.write(f"scale.py: rank {self._rank}: '{self._step}' took more than "
                         f"{self._timeout_s:g} s (--step-timeout); stacks:\n")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(3)


def _die_with_parent() -> None:
    """SIGKILL this worker if horovodrun dies (Linux): a killed run leaves no strays."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (gloo's full mesh alone needs several
    descriptors per peer; 1024 is a common default); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def _resources() -> Dict[str, int]:
    return {"fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task"))}


def _measure(hvd, dist, torch, sizes: List[int], iters: int,
             dog: Watchdog) -> List[Dict[str, Any]]:
    """This rank's median op time per size and library."""
    rows = []
    for nbytes in sizes:
        bufs = {lib: torch.ones(nbytes // 4, dtype=torch.float32) for lib in ("hvd", "gloo")}
        n_iter = iters if nbytes <= 1 << 20 else max(5, iters // 2)
        times: Dict[str, List[float]] = {"hvd": [], "gloo": []}
        for i in range(WARMUP + n_iter):
            for lib, t in bufs.items():
                dog.arm(f"{lib} allreduce {size_str(nbytes)}, round {i}")
                # Each library's op after its own barrier: the op's time then holds
                # that barrier's exit skew, not the other library's.
                hvd.barrier() if lib == "hvd" else dist.barrier()
                start = time.perf_counter()
                if lib == "hvd":
                    hvd.allreduce_(t, name=f"scale.{nbytes}", op=hvd.Sum)
                else:
                    dist.all_reduce(t)
                elapsed = time.perf_counter() - start
                if i == 0:  # the sum of ones is the world size; zeros stay exact after
                    if t[0].item() != hvd.size() or t[-1].item() != hvd.size():
                        raise RuntimeError(f"{lib} allreduce of {size_str(nbytes)} gave "
                                           f"{t[0].item()}, expected {hvd.size()}")
                    t.zero_()
                if i >= WARMUP:
                    times[lib].append(elapsed)
        row = {"bytes": nbytes, "iters": n_iter,
               **{f"{lib}_s": statistics.median(v) for lib, v in times.items()}}
        # The same ops back to back, one barrier before: no barrier exit skew inside.
        for lib, t in bufs.items():
            dog.arm(f"{lib} allreduce {size_str(nbytes)}, back to back")
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n_iter):
                if lib == "hvd":
                    hvd.allreduce_(t, name=f"scale.{nbytes}", op=hvd.Sum)
                else:
                    dist.all_reduce(t)
            row[f"{lib}_b2b_s"] = (time.perf_counter() - start) / n_iter
        rows.append(row)
    return rows


def worker(args: argparse.Namespace) -> None:
    """One rank: measures, gathers every rank's numbers, rank 0 writes args.result."""
    _die_with_parent()
    nofile = _raise_fd_limit()
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    dog = Watchdog(args.step_timeout, rank)
    t_import = time.time()
    import torch
    import torch.distributed as dist

    import horovod_torch as hvd
    me: Dict[str, Any] = {"import_s": time.time() - t_import, "nofile_limit": nofile}
    torch.set_num_threads(1)
    me["base"] = _resources()

    dog.arm("hvd.init()")
    start = time.time()
    hvd.init()
    me["hvd_init"] = (start, time.time())
    dog.arm("first hvd.allreduce")
    hvd.allreduce_(torch.ones(1024), name="scale.first", op=hvd.Sum)
    me["after_hvd"] = _resources()

    dog.arm("gloo init_process_group")
    start = time.time()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=hvd.rank(), world_size=hvd.size(),
                            timeout=timedelta(seconds=args.step_timeout))
    me["gloo_init"] = (start, time.time())
    me["after_gloo"] = _resources()

    me["rows"] = _measure(hvd, dist, torch, args.sizes, args.iters, dog)
    me["end"] = _resources()
    me["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    dog.arm("gathering results")
    everyone: List[Any] = [None] * hvd.size()
    dist.all_gather_object(everyone, me)
    if hvd.rank() == 0:
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(_combine(everyone, torch.__version__), f)
    dog.arm("shutdown")
    dist.destroy_process_group()
    hvd.shutdown()
    dog.stop()


def _combine(ranks: List[Dict[str, Any]], torch_version: str) -> Dict[str, Any]:
    """One rank count's result from every rank's numbers (max over ranks)."""
    out: Dict[str, Any] = {"ranks": len(ranks), "cpus": os.cpu_count(), "torch": torch_version,
                           "import_max_s": max(r["import_s"] for r in ranks),
                           "nofile_limit": min(r["nofile_limit"] for r in ranks)}
    for lib in ("hvd", "gloo"):
        starts = [r[f"{lib}_init"][0] for r in ranks]
        ends = [r[f"{lib}_init"][1] for r in ranks]
        out[f"{lib}_init_s"] = max(ends) - max(starts)
        out[f"{lib}_init_call_max_s"] = max(e - s for s, e in zip(starts, ends))
        out[f"{lib}_init_start_spread_s"] = max(starts) - min(starts)
    for stage in ("base", "after_hvd", "after_gloo", "end"):
        for key in ("fds", "threads"):
            out[f"{key}_{stage}"] = max(r[stage][key] for r in ranks)
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ranks)
    out["sizes"] = []
    for i, row in enumerate(ranks[0]["rows"]):
        hvd_s = max(r["rows"][i]["hvd_s"] for r in ranks)
        gloo_s = max(r["rows"][i]["gloo_s"] for r in ranks)
        out["sizes"].append({"bytes": row["bytes"], "iters": row["iters"], "hvd_s": hvd_s,
                             "gloo_s": gloo_s, "hvd_algbw_gbs": row["bytes"] / hvd_s / 1e9,
                             "gloo_algbw_gbs": row["bytes"] / gloo_s / 1e9,
                             **{f"{lib}_b2b_s": max(r["rows"][i][f"{lib}_b2b_s"] for r in ranks)
                                for lib in ("hvd", "gloo")}})
    return out


# ----------------------------------------------------------------- launcher side

def _stop(proc: "subprocess.Popen[bytes]") -> None:
    """SIGTERM horovodrun's group (it forwards to the workers and SIGKILLs them after
    its grace period), then SIGKILL what is left; workers die with their parent."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_count(np_: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Runs one rank count under horovodrun; its result, or {"ranks", "error"}."""
    fd, result = tempfile.mkstemp(prefix=f"scale{np_}.", suffix=".json")
    os.close(fd)
    env = dict(os.environ, BENCH_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    # Rendezvous waits for the slowest rank to import torch: allow the whole run for it.
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", str(np_),
           "-H", f"localhost:{np_}", "--start-timeout", str(int(args.timeout)),
           sys.executable, os.path.abspath(__file__), "--worker", "--result", result,
           "--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters),
           "--step-timeout", str(args.step_timeout)]
    print(f"\n# {np_} ranks: running (at most {args.timeout:g} s)", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        rc = None
    except BaseException:  # Ctrl-C: the job is in its own session, stop it too
        _stop(proc)
        os.unlink(result)
        raise
    try:
        with open(result, encoding="utf-8") as f:
            text = f.read()
    finally:
        os.unlink(result)
    if rc is None:
        return {"ranks": np_, "error": f"timed out after {args.timeout:g} s; job killed"}
    if rc != 0 or not text:
        why = " (a worker step exceeded --step-timeout: stacks above)" if rc == 3 else ""
        return {"ranks": np_, "error": f"horovodrun exited with code {rc}{why}"}
    out = json.loads(text)
    out["run_s"] = time.monotonic() - started
    return out


def format_count(r: Dict[str, Any]) -> str:
    """Markdown-friendly table of one rank count."""
    if "error" in r:
        return f"\n## {r['ranks']} ranks: FAILED ({r['error']})"
    lines = [
        f"\n## {r['ranks']} ranks ({r['cpus']} CPUs, torch {r['torch']}, whole run "
        f"{r['run_s']:.0f} s)\n",
        f"init: hvd {r['hvd_init_s']:.3f} s, gloo {r['gloo_init_s']:.3f} s (from the last "
        f"rank's call to the last return); longest call hvd {r['hvd_init_call_max_s']:.3f} s, "
        f"gloo {r['gloo_init_call_max_s']:.3f} s; ranks reached hvd.init() over "
        f"{r['hvd_init_start_spread_s']:.2f} s (import torch + horovod_torch: up to "
        f"{r['import_max_s']:.1f} s)\n",
        "| per process, max over ranks | before init | hvd.init + 1 allreduce | + gloo init "
        "| end |",
        "| --- | ---: | ---: | ---: | ---: |"]
    for key in ("fds", "threads"):
        lines.append(f"| {key} | " + " | ".join(
            str(r[f"{key}_{s}"]) for s in ("base", "after_hvd", "after_gloo", "end")) + " |")
    lines += [f"\npeak RSS {r['peak_rss_mb']:.0f} MB per process\n",
              "| size | hvd ms | gloo ms | gloo/hvd | hvd GB/s | gloo GB/s "
              "| hvd b2b ms | gloo b2b ms | gloo/hvd b2b |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in r["sizes"]:
        lines.append(f"| {size_str(s['bytes'])} | {s['hvd_s'] * 1e3:.3f} | "
                     f"{s['gloo_s'] * 1e3:.3f} | {s['gloo_s'] / s['hvd_s']:.2f}x | "
                     f"{s['hvd_algbw_gbs']:.3f} | {s['gloo_algbw_gbs']:.3f} | "
                     f"{s['hvd_b2b_s'] * 1e3:.3f} | {s['gloo_b2b_s'] * 1e3:.3f} | "
                     f"{s['gloo_b2b_s'] / s['hvd_b2b_s']:.2f}x |")
    return "\n".join(lines)


def format_summary(results: List[Dict[str, Any]]) -> str:
    """One line per rank count; latency of the smallest size (4 KB by default)."""
    ok = [r for r in results if "error" not in r]
    small = size_str(min(s["bytes"] for s in ok[0]["sizes"])) if ok else "4 KB"
    lines = ["\n## Summary (fds, threads: per process after hvd.init() + one allreduce)\n",
             f"| ranks | hvd init s | gloo init s | {small} hvd ms | {small} gloo ms | ratio "
             "| fds | threads |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['ranks']} | failed: {r['error']} | | | | | | |")
            continue
        s = min(r["sizes"], key=lambda s: s["bytes"])
        lines.append(f"| {r['ranks']} | {r['hvd_init_s']:.3f} | {r['gloo_init_s']:.3f} | "
                     f"{s['hvd_s'] * 1e3:.3f} | {s['gloo_s'] * 1e3:.3f} | "
                     f"{s['gloo_s'] / s['hvd_s']:.2f}x | {r['fds_after_hvd']} | "
                     f"{r['threads_after_hvd']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, action="append",
                   help="ranks (repeatable; default 8, 32, 64 and 128)")
    p.add_argument("--sizes", type=parse_sizes, default="4K,64K,1M,16M",
                   help="comma-separated float32 tensor sizes in bytes, K/M/G suffixes")
    p.add_argument("--iters", type=int, default=20,
                   help="timed ops per library per size (half, at least 5, above 1 MB)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one rank count may take before it is killed")
    p.add_argument("--step-timeout", type=float, default=180.0,
                   help="seconds one worker step (init, one op) may take")
    p.add_argument("--json", metavar="PATH", help="also write all results to PATH")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results = []
    for n in args.np or [8, 32, 64, 128]:
        results.append(run_count(n, args))
        print(format_count(results[-1]), flush=True)
        if args.json:  # rewritten after every count: a later failure keeps the earlier ones
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1)
    print(format_summary(results), flush=True)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
