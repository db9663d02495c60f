"""Scale benchmark on one host's CPUs: hvd.allreduce vs torch.distributed (gloo) at
many ranks. Prints, per rank count, init time, allreduce latency and bandwidth with
the ratio gloo/hvd, and per-process file descriptors, threads and peak RSS; then a
summary table over all rank counts.

    python bench/scale.py --np 8 --np 32 --np 64 --np 128 [--sizes 4K,64K,1M,16M]
                          [--iters 20] [--timeout 600] [--step-timeout 180] [--json PATH]

Start-up, the headline of issue #22 item 9: the wall time from the launcher's start
to the first completed allreduce on every rank (the latest rank's first allreduce
done, minus the moment the launcher process was started), for horovodrun + hvd.init()
+ one hvd.allreduce, and side by side for torchrun + dist.init_process_group("gloo")
+ one dist.all_reduce, a torchrun job of its own (``torchrun --nproc_per_node N``)
run right after. Both split it into "workers started" (the latest worker's first
line of Python), "imports done" (the latest rank through ``import torch``, and
horovod_torch for hvd) and the rest: the rendezvous and the first op, which is what
the launcher and the library add beyond process start-up. Before the first count
one ``import torch, horovod_torch`` warms the page cache, so neither launcher pays
the cold start alone. ``--startup-only`` skips everything else (each hvd rank ends
after its first allreduce).

    python bench/scale.py --np 4 --np 8 --startup-only      # 2 cores: a few minutes

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
import time

_T_ENTRY = time.time()  # this worker's first line of Python (start-up, below)

import argparse  # noqa: E402
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
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

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
    hvd.init  # noqa: B018  (loads the API and the extension: part of the imports)
    t_ready = time.time()
    me: Dict[str, Any] = {"import_s": t_ready - t_import, "nofile_limit": nofile}
    torch.set_num_threads(1)
    me["base"] = _resources()

    dog.arm("hvd.init()")
    start = time.time()
    hvd.init()
    me["hvd_init"] = (start, time.time())
    dog.arm("first hvd.allreduce")
    first = torch.ones(1024)
    hvd.allreduce_(first, name="scale.first", op=hvd.Sum)
    me["startup"] = _stamps(t_ready, first, hvd.size())
    me["after_hvd"] = _resources()
    if args.startup_only:
        dog.arm("gathering results")
        everyone = hvd.allgather_object(me["startup"])
        if hvd.rank() == 0:
            with open(args.result, "w", encoding="utf-8") as f:
                json.dump({"ranks": hvd.size(), "cpus": os.cpu_count(),
                           "torch": torch.__version__,
                           "startup": _combine_startup(everyone)}, f)
        dog.arm("shutdown")
        hvd.shutdown()
        dog.stop()
        return

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


def _stamps(t_ready: float, first: Any, size: int) -> Dict[str, float]:
    """This rank's start-up: wall-clock times (s since the epoch; one host's clocks
    agree) of its first line of Python, of the end of its imports, and of its first
    allreduce's completion, after checking that allreduce's result (a sum of ones)."""
    done = time.time()
    if first[0].item() != size or first[-1].item() != size:
        raise RuntimeError(f"the first allreduce gave {first[0].item()}, expected {size}")
    return {"entry": _T_ENTRY, "ready": t_ready, "first_allreduce": done}


def _combine_startup(ranks: List[Dict[str, float]]) -> Dict[str, float]:
    """The latest rank's time of each start-up stamp (absolute; the launching side
    subtracts the launcher's start)."""
    return {key: max(r[key] for r in ranks) for key in ("entry", "ready", "first_allreduce")}


def gloo_worker(args: argparse.Namespace) -> None:
    """One rank of the torchrun job: imports torch, dist.init_process_group("gloo")
    (env:// from torchrun), one 4 KB dist.all_reduce; rank 0 writes the start-up."""
    _die_with_parent()
    _raise_fd_limit()
    rank = int(os.environ.get("RANK", "0"))
    dog = Watchdog(args.step_timeout, rank)
    dog.arm("importing torch")
    import torch
    import torch.distributed as dist
    t_ready = time.time()
    torch.set_num_threads(1)
    dog.arm("gloo init_process_group")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.step_timeout))
    dog.arm("first gloo all_reduce")
    first = torch.ones(1024)
    dist.all_reduce(first)
    me = _stamps(t_ready, first, dist.get_world_size())
    dog.arm("gathering results")
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    if rank == 0:
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump({"ranks": len(everyone), "startup": _combine_startup(everyone)}, f)
    dog.arm("shutdown")
    dist.destroy_process_group()
    dog.stop()


def _combine(ranks: List[Dict[str, Any]], torch_version: str) -> Dict[str, Any]:
    """One rank count's result from every rank's numbers (max over ranks)."""
    out: Dict[str, Any] = {"ranks": len(ranks), "cpus": os.cpu_count(), "torch": torch_version,
                           "import_max_s": max(r["import_s"] for r in ranks),
                           "nofile_limit": min(r["nofile_limit"] for r in ranks),
                           "startup": _combine_startup([r["startup"] for r in ranks])}
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


def _run_job(what: str, cmd: List[str], env: Dict[str, str], result: str,
             timeout_s: float) -> Tuple[Optional[Dict[str, Any]], Optional[str], float]:
    """Runs one launcher command in a session of its own: (the JSON its rank 0 wrote,
    None, launcher start) or (None, why it failed, launcher start). The launcher
    start is the wall-clock time just before the launcher process was created."""
    launched = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        rc = None
    except BaseException:  # Ctrl-C: the job is in its own session, stop it too
        _stop(proc)
        raise
    try:
        with open(result, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        text = ""
    if rc is None:
        return None, f"timed out after {timeout_s:g} s; job killed", launched
    if rc != 0 or not text:
        why = " (a worker step exceeded --step-timeout: stacks above)" if rc == 3 else ""
        return None, f"{what} exited with code {rc}{why}", launched
    return json.loads(text), None, launched


def _warm_page_cache() -> None:
    """Imports torch and horovod_torch once, so that the first launcher measured does
    not pay alone for reading them from disk."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", "import torch, torch.distributed, horovod_torch"],
                   env=env, check=False)


def _relative_startup(startup: Dict[str, float], launched: float) -> Dict[str, float]:
    """Start-up stamps as seconds after the launcher's start, plus the part after
    the imports (rendezvous and the first op)."""
    out = {f"{key}_s": value - launched for key, value in startup.items()}
    out["after_imports_s"] = startup["first_allreduce"] - startup["ready"]
    return out


def _temp_result(np_: int, tag: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f"scale{np_}.{tag}.", suffix=".json")
    os.close(fd)
    return path


def run_torchrun(np_: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Start-up of torchrun + gloo at np_ ranks: {"first_allreduce_s", ...} or
    {"error"}."""
    result = _temp_result(np_, "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(np_), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.abspath(__file__), "--gloo-worker",
           "--result", result, "--step-timeout", str(args.step_timeout)]
    print(f"# {np_} ranks: torchrun + gloo start-up (at most {args.timeout:g} s)", flush=True)
    try:
        out, error, launched = _run_job("torchrun", cmd, env, result, args.timeout)
    finally:
        os.unlink(result)
    if out is None:
        return {"error": error}
    return _relative_startup(out["startup"], launched)


def run_count(np_: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Runs one rank count under horovodrun, then torchrun + gloo's start-up; its
    result, or {"ranks", "error"} (with "startup" when only the hvd job failed)."""
    result = _temp_result(np_, "hvd")
    env = dict(os.environ, BENCH_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    # Rendezvous waits for the slowest rank to import torch: allow the whole run for it.
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", str(np_),
           "-H", f"localhost:{np_}", "--start-timeout", str(int(args.timeout)),
           sys.executable, os.path.abspath(__file__), "--worker", "--result", result,
           "--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters),
           "--step-timeout", str(args.step_timeout)]
    if args.startup_only:
        cmd.append("--startup-only")
    print(f"\n# {np_} ranks: running (at most {args.timeout:g} s)", flush=True)
    started = time.monotonic()
    try:
        out, error, launched = _run_job("horovodrun", cmd, env, result, args.timeout)
    finally:
        os.unlink(result)
    run_s = time.monotonic() - started
    gloo = run_torchrun(np_, args)
    if out is None:
        return {"ranks": np_, "error": error, "startup": {"gloo": gloo}}
    out["run_s"] = run_s
    out["startup"] = {"hvd": _relative_startup(out["startup"], launched), "gloo": gloo}
    return out


def _startup_line(r: Dict[str, Any]) -> str:
    """One rank count's start-up, both launchers, in words."""
    parts = []
    for lib, name in (("hvd", "horovodrun + hvd"), ("gloo", "torchrun + gloo")):
        s = r.get("startup", {}).get(lib)
        if s is None:
            continue
        if "error" in s:
            parts.append(f"{name}: failed ({s['error']})")
            continue
        parts.append(f"{name} {s['first_allreduce_s']:.2f} s (workers started by "
                     f"{s['entry_s']:.2f} s, imports done by {s['ready_s']:.2f} s, then "
                     f"{s['after_imports_s']:.2f} s to the first allreduce)")
    return ("start-up, launcher start to the first allreduce done on every rank: "
            + "; ".join(parts) + "\n")


def format_count(r: Dict[str, Any]) -> str:
    """Markdown-friendly table of one rank count."""
    if "error" in r:
        return f"\n## {r['ranks']} ranks: FAILED ({r['error']})\n\n" + _startup_line(r)
    head = (f"\n## {r['ranks']} ranks ({r['cpus']} CPUs, torch {r['torch']}, whole "
            f"horovodrun run {r['run_s']:.0f} s)\n\n" + _startup_line(r))
    if "sizes" not in r:  # --startup-only
        return head
    lines = [
        head,
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


def _seconds(s: Optional[Dict[str, Any]], key: str) -> str:
    return "failed" if s is None or "error" in s else f"{s[key]:.2f}"


def format_startup_summary(results: List[Dict[str, Any]]) -> str:
    """Start-up per rank count, horovodrun + hvd beside torchrun + gloo: launcher
    start to the first allreduce done on every rank, and its part after the imports."""
    lines = ["\n## Start-up: launcher start to the first allreduce done on every rank "
             "(s)\n",
             "| ranks | horovodrun + hvd | torchrun + gloo | hvd / gloo | hvd after imports "
             "| gloo after imports | workers started, hvd / gloo |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        hvd = r.get("startup", {}).get("hvd")
        gloo = r.get("startup", {}).get("gloo")
        both = all(s is not None and "error" not in s for s in (hvd, gloo))
        ratio = (f"{hvd['first_allreduce_s'] / gloo['first_allreduce_s']:.2f}x"  # type: ignore
                 if both else "")
        lines.append(f"| {r['ranks']} | {_seconds(hvd, 'first_allreduce_s')} | "
                     f"{_seconds(gloo, 'first_allreduce_s')} | {ratio} | "
                     f"{_seconds(hvd, 'after_imports_s')} | {_seconds(gloo, 'after_imports_s')} "
                     f"| {_seconds(hvd, 'entry_s')} / {_seconds(gloo, 'entry_s')} |")
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
    p.add_argument("--startup-only", action="store_true",
                   help="measure start-up only (launcher start to the first allreduce, "
                        "horovodrun + hvd and torchrun + gloo), none of the ops after it")
    p.add_argument("--json", metavar="PATH", help="also write all results to PATH")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.gloo_worker:
        gloo_worker(args)
        return
    _warm_page_cache()
    results = []
    for n in args.np or [8, 32, 64, 128]:
        results.append(run_count(n, args))
        print(format_count(results[-1]), flush=True)
        if args.json:  # rewritten after every count: a later failure keeps the earlier ones
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1)
    ops = "" if args.startup_only else format_summary(results)
    print(format_startup_summary(results) + ops, flush=True)
    if any("error" in r or "error" in r.get("startup", {}).get("gloo", {}) for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
