"""Where a training step's time goes on the GPU and on the host, per contender (#38,
goal 2): hvd.DistributedOptimizer, DDP and no communication, in the same processes.

    python bench/profile_gpu.py --np 2 [--model resnet50] [--batch-size 32] [--steps 20]

Each contender runs a few warm-up steps, then `--steps` timed steps and the same number
under a CUDA-only torch.profiler (kernels only). Rank 0 prints, in milliseconds per step:

  host fwd / bwd / opt   host time in the forward call, loss.backward() and opt.step()
                         (medians)
  gpu fwd / bwd / opt    time the GPU stream took from the host's mark at one phase's
                         start to the next (its kernels, and any wait for the host to
                         launch them; medians)
  step                   host time per step, mean over the timed steps
  drain                  how far the GPU was behind the host after the last timed step
                         (near 0: the host sets the pace)
  profiled step          host time per step under the profile, which costs the host
                         per launch: the rows below come from these slower steps, so
                         compare them across contenders, not with `step`
  gpu compute            from the profile: time in which a kernel other than NCCL's runs
  gpu nccl / nccl exposed  time in NCCL kernels / in NCCL kernels with no other running
  gpu idle               no kernel at all (first kernel to last)
  kernels, nccl kernels  counts per step

`--split` adds the host's time in `opt.zero_grad()`, and for the hvd contenders where
its time in `opt.step()` goes (medians over the timed steps): `synchronize()` in all,
the part of it in the wait for the gradients' allreduces (`_wait_many`, or with the
C++ hooks `wait_all()`: the wait for the background thread to enqueue the last of them,
and the stream waits), for `_wait_many` how many of them were not yet enqueued when the
wait began, and the wrapped optimizer's own step.

`--trace-dir` keeps each contender's trace (rank 0); with `--cpu` the profile also
records the host's ops and CUDA calls (slower steps, a larger trace).
"""
import argparse
import json
import os
import statistics
import shutil
import sys
import tempfile
import time

from _launch import launch_self


def _union(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(trace_path, steps):
    """GPU time per step (milliseconds) from a CUDA-only trace of torch.profiler over
    `steps` steps: kernels other than NCCL's, NCCL's, NCCL's with nothing else running,
    and no kernel at all (between the first kernel and the last)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels, nccl = [], []
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            iv = (ev["ts"], ev["ts"] + ev.get("dur", 0))
            (nccl if "nccl" in ev.get("name", "").lower() else kernels).append(iv)
    if not kernels:
        return {}
    span = max(e for _, e in kernels + nccl) - min(s for s, _ in kernels + nccl)
    compute, busy = _union(kernels), _union(kernels + nccl)
    per = 1000.0 * steps
    return {"gpu compute": compute / per, "gpu nccl": _union(nccl) / per,
            "nccl exposed": (busy - compute) / per, "gpu idle": (span - busy) / per,
            "nccl kernels": len(nccl) / steps, "kernels": len(kernels) / steps}


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import horovod_torch as hvd
    from train_gpu import _batch, _contender, _init, _step
    dev = _init()
    is_lm = args.model == "transformer"
    data, target = _batch(args.model, args.batch_size, dev)

    def mark(marks):
        """The host's time and a CUDA event on the current stream, now."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((time.perf_counter(), ev))

    def step(net, opt, marks=None):
        """One step; with marks, a mark at each phase's start."""
        _step(net, opt, data, target, is_lm,
              mark=None if marks is None else lambda: mark(marks))

    phases = ("fwd", "bwd", "opt")
    results = {}
    for n, lib in enumerate(args.libs.split(",")):
        net, opt = _contender(lib, args.model, dev)
        split = _split(opt, lib.startswith("hvd")) if args.split else None
        for _ in range(args.warmup):
            step(net, opt)
        torch.cuda.synchronize()
        dist.barrier()
        # Unprofiled steps, timed: each phase on the host and on the GPU (the time
        # the stream took from one phase's mark to the next: its kernels and any wait
        # for the host to launch them). A last mark closes the last step's opt phase.
        marks = []
        for _ in range(args.steps):
            step(net, opt, marks)
        mark(marks)
        t_sync = time.perf_counter()
        torch.cuda.synchronize()
        drain = time.perf_counter() - t_sync
        row = {}
        for i, name in enumerate(phases):
            pairs = [(marks[j], marks[j + 1]) for j in range(i, len(marks) - 1, 3)]
            row[f"host {name}"] = statistics.median(b[0] - a[0] for a, b in pairs) * 1e3
            row[f"gpu {name}"] = statistics.median(a[1].elapsed_time(b[1]) for a, b in pairs)
        row["step"] = (marks[-1][0] - marks[0][0]) / args.steps * 1e3
        row["drain"] = drain * 1e3
        if split is not None:
            row.update({k: statistics.median(v[-args.steps:]) for k, v in split.items() if v})
        # The same number of steps under a CUDA-only profile (no CPU op events, so the
        # host pays less than with them, but still a cost per launch: `profiled step`).
        dist.barrier()
        t0 = time.perf_counter()
        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.cpu else [])
        with profile(activities=acts) as prof:
            for _ in range(args.steps):
                step(net, opt)
            torch.cuda.synchronize()
        row["profiled step"] = (time.perf_counter() - t0) / args.steps * 1e3
        if hvd.rank() == 0:
            tmp = args.trace_dir or tempfile.mkdtemp(prefix="hvd-prof-")
            os.makedirs(tmp, exist_ok=True)
            path = os.path.join(tmp, f"{lib}.rank0.json")
            prof.export_chrome_trace(path)
            row.update(summarize(path, args.steps))
            if not args.trace_dir:
                shutil.rmtree(tmp)
        results[lib if lib not in results else f"{lib}#{n}"] = row
        del net, opt
        torch.cuda.synchronize()
        dist.barrier()
    if hvd.rank() == 0:
        print(f"\nprofile: {args.model} batch {args.batch_size}/GPU on {hvd.size()} x "
              f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__}), rank 0, "
              f"{args.steps} steps timed and {args.steps} profiled, ms per step")
        keys = list(dict.fromkeys(k for row in results.values() for k in row))
        print(f"{'':13}" + "".join(f"{lib:>10}" for lib in results))
        for k in keys:
            fmt = "{:10.0f}" if "kernels" in k or "not enqueued" in k else "{:10.2f}"
            print(f"{k:13}" + "".join(fmt.format(results[lib].get(k, 0.0)) for lib in results))
        sys.stdout.flush()
    dist.destroy_process_group()
    hvd.shutdown()


def _split(opt, hvd_parts):
    """Times `opt.zero_grad()`, and with `hvd_parts` the parts of an hvd optimizer's
    step (see --split): returns the dict of lists the wrappers append to, in
    milliseconds (and a count)."""
    from horovod_torch import _C
    from horovod_torch.training import optimizer as module
    times = {"zero_grad": []}
    opt.zero_grad = _timed(times, "zero_grad", opt.zero_grad)
    if not hvd_parts:
        return times
    times.update({"sync": [], "sync wait": [], "not enqueued": [], "local step": []})
    wait_many = getattr(module._wait_many, "unwrapped", module._wait_many)
    synchronize, local_step = opt.synchronize, opt._local_step

    def waiting(handles):
        # (a look at each handle's event: a few microseconds each, inside "sync")
        times["not enqueued"].append(sum(1 for h in handles if not _C.poll(h)))
        return _timed(times, "sync wait", wait_many)(handles)

    waiting.unwrapped = wait_many
    module._wait_many = waiting  # (left in place: the next hvd contender replaces it)
    if hasattr(opt._native, "wait_all"):  # the C++ hooks' step: synchronize() waits there
        opt._native = _NativeTimed(opt._native, _timed(times, "sync wait", opt._native.wait_all))
    opt.synchronize = _timed(times, "sync", synchronize)
    opt._local_step = _timed(times, "local step", local_step)
    return times


class _NativeTimed:
    """The optimizer's _C.GradHooks with its wait_all() timed."""

    def __init__(self, native, wait_all):
        self._native, self.wait_all = native, wait_all

    def __getattr__(self, name):
        return getattr(self._native, name)


def _timed(times, key, fn):
    """fn, appending each call's milliseconds to times[key]."""
    def call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            times[key].append((time.perf_counter() - t0) * 1e3)
    return call


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--libs", default="hvd,ddp,none")
    p.add_argument("--trace-dir", default="")
    p.add_argument("--cpu", action="store_true", help="profile the host too (see above)")
    p.add_argument("--split", action="store_true",
                   help="time the parts of hvd's opt.step() (see the module's docstring)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    argv = [a for a in sys.argv[1:]]
    sys.exit(launch_self(__file__, args.np, argv))


if __name__ == "__main__":
    main()
