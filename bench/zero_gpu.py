"""Sharded optimizer state (ZeRO-1): hvd.DistributedOptimizer(shard_optimizer_state=True)
against the unsharded hvd optimizer and DDP + ZeroRedundancyOptimizer (NCCL), AdamW.

    python bench/zero_gpu.py [--np N] [--batch-size 8] [--contenders hvd,hvd-sharded,ddp-zero]
    python bench/zero_gpu.py --max-depth [--np N] [--max-trials 10]
    python bench/zero_gpu.py --device cpu --np 2          # smoke test, no GPU needed

Contenders, each on the ~368M transformer of bench/train_gpu.py (bf16 autocast, batch 8
x 512 tokens per GPU) with torch.optim.AdamW(lr=1e-4):

- hvd: hvd.DistributedOptimizer (every rank keeps all of AdamW's state);
- hvd-sharded: the same with shard_optimizer_state=True (each rank keeps the state of
  the parameters it owns, then allgathers the updated parameters); `hvd-sharded2`
  (shard_optimizer_state=2, which also drops the gradients of the others' parameters)
  can be added with --contenders, and so can `hvd-sharded-rs` (shard_optimizer_state=2
  with reduce_scatter_gradients=True: each gradient reduced to its owner only).
  Skipped, with a line saying so, where the installed horovod_torch rejects the
  keyword;
- ddp-zero: DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer.

A default run does two phases in one launch (the contenders in the same processes):

1. memory, one contender at a time: build it, train --mem-steps steps between
   torch.cuda.reset_peak_memory_stats() and max_memory_allocated(), note the bytes of
   its optimizer state on each rank, free it all (gc, empty_cache). The hvd engine's
   fusion buffer and the cuBLAS workspaces are made before the first contender, so
   they count alike for all.
   The goal line checks hvd-sharded peak <= hvd peak - (N-1)/N x the full state,
   with 5% slack on the right-hand side (peaks net of what was allocated before the
   contender was built, largest over the ranks);
2. throughput: all contenders built at once, taking turns block by block (the first
   of each round rotating) as in bench/train_gpu.py; seq/s per GPU (median over
   blocks, slowest rank) and total, and the ratios hvd-sharded/ddp-zero and
   hvd-sharded/hvd.

`--max-depth` instead finds, for hvd and hvd-sharded (or --contenders), the deepest
transformer (encoder layers of width --d-model) that trains --trial-steps steps
without running out of GPU memory: doubling from --start-depth (a sharded contender
starts from hvd's depth and grows by 1.25x), then bisecting, each trial a fresh launch
of N ranks so that an OOM leaves nothing behind; at most --max-trials trials per
contender (the bracket is printed if the cap stops it). A trial passes when every
rank finished its steps; a rank that fails writes why and exits, and horovodrun stops
the others.

Lines starting with `|` and the summary lines are meant to be pasted into
docs/benchmarks.md. `--device cpu` runs a tiny transformer (d_model 64, 2 layers,
batch 2 x 32) with gloo for DDP and no memory figures, to check the script end to end.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

from _launch import launch_self
from train_gpu import _batch, _build, _step

ALL_CONTENDERS = ["hvd", "hvd-sharded", "hvd-sharded2", "hvd-sharded-rs", "ddp-zero"]
MB = 1 << 20
VOCAB = 32000


class Unsupported(Exception):
    """The installed horovod_torch has no shard_optimizer_state."""


def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    warnings.filterwarnings("ignore", message=".*CUDA is not available.*")


def _model(d_model: int, layers: int, dev):
    """The train_gpu.py transformer with `layers` encoder layers; another width than
    1024 keeps its shape (heads of 64, feed-forward 4 x d_model)."""
    import torch
    import torch.nn as nn
    with torch.device(dev):  # parameters made on the device, not copied there
        if d_model == 1024:
            return _build("transformer", dev, layers=layers)
        layer = nn.TransformerEncoderLayer(d_model=d_model, nhead=max(1, d_model // 64),
                                           dim_feedforward=4 * d_model, batch_first=True,
                                           norm_first=True)
        return nn.Sequential(nn.Embedding(VOCAB, d_model), nn.TransformerEncoder(layer, layers),
                             nn.Linear(d_model, VOCAB)).to(dev)


def _data(batch_size: int, seq_len: int, dev):
    import torch
    if seq_len <= 512:
        data, target = _batch("transformer", batch_size, dev)
        return data[:, :seq_len].contiguous(), target[:, :seq_len].contiguous()
    return (torch.randint(0, VOCAB, (batch_size, seq_len), device=dev),
            torch.randint(0, VOCAB, (batch_size, seq_len), device=dev))


def _make(lib: str, model, dev):
    """(net, optimizer) of contender `lib` around `model`."""
    import torch
    import horovod_torch as hvd
    if lib.startswith("hvd"):
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
        kw = {}
        if lib != "hvd":
            kw["shard_optimizer_state"] = 1 if lib == "hvd-sharded" else 2
        if lib == "hvd-sharded-rs":
            kw["reduce_scatter_gradients"] = True
        try:
            opt = hvd.DistributedOptimizer(adamw, named_parameters=model.named_parameters(),
                                           **kw)
        except TypeError as exc:
            if "shard_optimizer_state" in str(exc) or "reduce_scatter_gradients" in str(exc):
                raise Unsupported(str(exc)) from None
            raise
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, opt
    from torch.distributed.optim import ZeroRedundancyOptimizer
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=1e-4)
    return ddp, opt


def _state_bytes(opt) -> int:
    """Bytes of the tensors in this rank's optimizer state."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    state = opt.optim.state if isinstance(opt, ZeroRedundancyOptimizer) else opt.state
    total = 0
    for s in state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def _init(args):
    """hvd, the device, and the torch.distributed group (NCCL on GPU, gloo on CPU)."""
    import torch
    import torch.distributed as dist
    import horovod_torch as hvd
    _quiet()
    hvd.init()
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
        dev = torch.device("cuda", hvd.local_rank())
        dist.init_process_group("nccl",
                                init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                                rank=hvd.rank(), world_size=hvd.size(), device_id=dev)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
        dist.init_process_group("gloo",
                                init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                                rank=hvd.rank(), world_size=hvd.size())
    return dev


def _header(args, dev, n: int, params: int) -> str:
    import torch
    import horovod_torch as hvd
    if dev.type == "cuda":
        where = (f"{n} x {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, NCCL "
                 f"{'.'.join(map(str, torch.cuda.nccl.version()))} (hvd built with NCCL code "
                 f"{hvd.nccl_built()})")
    else:
        where = f"{n} CPU ranks, torch {torch.__version__}, gloo for DDP"
    return (f"transformer {args.layers} x {args.d_model} ({params / 1e6:.1f}M parameters), "
            f"AdamW lr 1e-4, bf16 autocast, batch {args.batch_size} x {args.seq_len} per "
            f"rank, on {where}")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import horovod_torch as hvd
    dev = _init(args)
    cuda = dev.type == "cuda"
    n, me = hvd.size(), hvd.rank()
    data, target = _data(args.batch_size, args.seq_len, dev)
    libs = args.contenders.split(",")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def build(lib):
        torch.manual_seed(0)
        model = _model(args.d_model, args.layers, dev)
        net, opt = _make(lib, model, dev)
        return net, opt, model

    def agree(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    # What stays allocated once made, before any contender's figures, so that it
    # counts alike for all: the engine's fusion buffer (64 MB by default) and the
    # cuBLAS workspaces of this thread and of autograd's (a bf16 forward and backward).
    warm = [torch.zeros(40 * MB // 4, device=dev) for _ in range(2)]
    hvd.grouped_allreduce(warm, name="zero_gpu.warmup")
    lin = torch.nn.Linear(256, 256, device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
        lin(torch.randn(64, 256, device=dev)).float().sum().backward()
    del warm, lin
    dist.barrier()
    sync()

    # Phase 1: each contender alone; its peak memory and optimizer state.
    mem, params, skipped = {}, 0, {}
    for lib in list(libs):
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev) if cuda else 0
        try:
            net, opt, model = build(lib)
            ok = True
        except Unsupported as exc:
            ok, why = False, str(exc)
        if not agree(ok):
            skipped[lib] = why if not ok else "rejected on another rank"
            libs.remove(lib)
            if me == 0:
                print(f"{lib}: skipped, this horovod_torch lacks its keyword "
                      f"({skipped[lib]})", flush=True)
            net = opt = model = None
            continue
        for _ in range(args.mem_steps):
            _step(net, opt, data, target, True)
        sync()
        params = sum(p.numel() for p in model.parameters())
        mine = {"state": _state_bytes(opt), "before": before,
                "peak": torch.cuda.max_memory_allocated(dev) if cuda else 0}
        del net, opt, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        mine["after"] = torch.cuda.memory_allocated(dev) if cuda else 0
        mem[lib] = hvd.allgather_object(mine, name=f"zero_gpu.mem.{lib}")
        dist.barrier()
    if not libs:
        raise SystemExit("no contender left")

    if me == 0:
        print(f"\n{_header(args, dev, n, params)}", flush=True)
        _print_memory(libs, mem, n, cuda, args.mem_steps)

    # Phase 2: all contenders at once, interleaved blocks.
    setups = {lib: build(lib)[:2] for lib in libs}
    for lib in libs:
        for _ in range(args.warmup):
            _step(*setups[lib], data, target, True)
    sync()
    rates = {lib: [] for lib in libs}
    for block in range(args.iters):
        for lib in libs[block % len(libs):] + libs[:block % len(libs)]:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                _step(*setups[lib], data, target, True)
            sync()
            rates[lib].append(args.batch_size * args.steps / (time.perf_counter() - t0))
    rate = {}
    for lib, v in rates.items():
        t = torch.tensor([statistics.median(v)], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)  # the slowest rank sets the pace
        rate[lib] = t.item()
    if me == 0:
        print(f"\nthroughput, median of {args.iters} interleaved blocks of {args.steps} steps "
              f"(after {args.warmup} warm-up steps each), slowest rank:")
        per = "GPU" if cuda else "rank"
        print(f"| contender | seq/s per {per} | seq/s total | blocks (seq/s per {per}, rank 0) |")
        print("| --- | ---: | ---: | --- |")
        for lib in libs:
            blocks = " ".join(f"{x:.1f}" for x in rates[lib])
            print(f"| {lib} | {rate[lib]:.1f} | {rate[lib] * n:.1f} | {blocks} |")
        for a, b in [("hvd-sharded", "ddp-zero"), ("hvd-sharded", "hvd"),
                     ("hvd-sharded2", "ddp-zero"), ("hvd-sharded2", "hvd"),
                     ("hvd-sharded-rs", "ddp-zero"), ("hvd-sharded-rs", "hvd"),
                     ("hvd-sharded-rs", "hvd-sharded"), ("hvd", "ddp-zero")]:
            if a in rate and b in rate:
                print(f"{a}/{b} throughput ratio: {rate[a] / rate[b]:.3f}")
        for lib, why in skipped.items():
            print(f"{lib}: skipped ({why})")
        sys.stdout.flush()
    dist.destroy_process_group()
    hvd.shutdown()


def _print_memory(libs, mem, n: int, cuda: bool, steps: int) -> None:
    """Rank 0's report of phase 1 (mem[lib]: every rank's figures, in rank order)."""
    print(f"\nmemory, each contender alone for {steps} steps; per rank (rank 0 / rank 1 / ...)"
          + ("" if cuda else "; no GPU figures on CPU"))
    full = max(r["state"] for r in mem["hvd"]) if "hvd" in mem else None
    if cuda:
        print("| contender | peak allocated MB | own peak MB (peak - allocated before) "
              "| optimizer state MB | state / unsharded | left allocated after MB |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
    else:
        print("| contender | optimizer state MB | state / unsharded |")
        print("| --- | ---: | ---: |")
    for lib in libs:
        rs = mem[lib]
        state = " / ".join(f"{r['state'] / MB:.1f}" for r in rs)
        frac = (" / ".join(f"{r['state'] / full:.3f}" for r in rs) if full else "-")
        if cuda:
            peak = " / ".join(f"{r['peak'] / MB:.0f}" for r in rs)
            own = " / ".join(f"{(r['peak'] - r['before']) / MB:.0f}" for r in rs)
            left = " / ".join(f"{(r['after'] - r['before']) / MB:.0f}" for r in rs)
            print(f"| {lib} | {peak} | {own} | {state} | {frac} | {left} |")
        else:
            print(f"| {lib} | {state} | {frac} |")
    if full is None or not any(l.startswith("hvd-sharded") for l in libs):
        print("goal check: needs the hvd and hvd-sharded contenders, skipped")
        return
    for lib in libs:
        if not lib.startswith("hvd-sharded"):
            continue
        sharded_state = sum(r["state"] for r in mem[lib])
        print(f"{lib} state over all ranks: {sharded_state / MB:.1f} MB (unsharded, per rank: "
              f"{full / MB:.1f} MB); largest rank holds "
              f"{max(r['state'] for r in mem[lib]) / full:.3f} of it, 1/N = {1 / n:.3f}")
        if not cuda:
            continue
        own = lambda l: max(r["peak"] - r["before"] for r in mem[l])  # noqa: E731
        bound = own("hvd") - (n - 1) / n * full
        got = own(lib)
        verdict = "PASS" if got <= 1.05 * bound else "FAIL"
        saved, expected = own("hvd") - got, (n - 1) / n * full
        print(f"goal {lib}: own peak {got / MB:.0f} MB <= 1.05 x (hvd {own('hvd') / MB:.0f} MB "
              f"- {n - 1}/{n} x state {full / MB:.0f} MB = {bound / MB:.0f} MB) = "
              f"{1.05 * bound / MB:.0f} MB: {verdict} (saved {saved / MB:.0f} MB of the "
              f"{expected / MB:.0f} MB the state accounts for, {saved / expected:.0%})")
    sys.stdout.flush()


# -- --max-depth -----------------------------------------------------------------


def trial(args) -> None:
    """One rank of one depth trial: trains --trial-steps steps, writes its outcome to
    OUT.RANK.json, and leaves at once (os._exit) when it failed, so that horovodrun
    stops the ranks that wait for it in a collective."""
    import threading
    import torch
    import horovod_torch as hvd
    threading.Timer(args.trial_timeout, os._exit, (4,)).start()  # a hang ends the trial
    _quiet()
    hvd.init()
    me = hvd.rank()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
        dev = torch.device("cuda", hvd.local_rank())
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    if args.contender == "ddp-zero":
        import torch.distributed as dist
        dist.init_process_group("nccl" if cuda else "gloo",
                                init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                                rank=me, world_size=hvd.size(),
                                **({"device_id": dev} if cuda else {}))
    result = {"ok": False, "oom": False, "unsupported": False, "params": 0, "peak": 0,
              "error": ""}
    t0 = time.perf_counter()
    try:
        data, target = _data(args.batch_size, args.seq_len, dev)
        torch.manual_seed(0)
        model = _model(args.d_model, args.layers, dev)
        result["params"] = sum(p.numel() for p in model.parameters())
        net, opt = _make(args.contender, model, dev)
        for _ in range(args.trial_steps):
            if args.fake_oom_above and args.layers > args.fake_oom_above and me == hvd.size() - 1:
                raise torch.OutOfMemoryError("fake OOM (--fake-oom-above)")
            _step(net, opt, data, target, True)
        if cuda:
            torch.cuda.synchronize()
            result["peak"] = torch.cuda.max_memory_allocated(dev)
        result["ok"] = True
    except Unsupported as exc:
        result["unsupported"], result["error"] = True, str(exc)
    except Exception as exc:  # pylint: disable=broad-except
        text = f"{type(exc).__name__}: {exc}"
        result["oom"] = (isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower()
                         or "CUBLAS_STATUS_ALLOC_FAILED" in text)
        result["error"] = text.splitlines()[0][:300] if text else type(exc).__name__
    result["seconds"] = time.perf_counter() - t0
    with open(f"{args.out}.{me}.json", "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    if not result["ok"]:
        os._exit(0 if result["unsupported"] else 3)
    if args.contender == "ddp-zero":
        import torch.distributed as dist
        dist.destroy_process_group()
    hvd.shutdown()
    os._exit(0)


def max_depth(args, n: int, forwarded) -> None:
    """Doubling, then bisecting, the depth of each contender; one launch per trial."""
    libs = args.contenders.split(",")
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        def run_trial(lib, depth):
            out = os.path.join(tmp, f"{lib}.{depth}")
            t0 = time.perf_counter()
            rc = launch_self(__file__, n, [*forwarded, "--trial", "--contender", lib,
                                           "--layers", str(depth), "--out", out])
            rs = []
            for r in range(n):
                try:
                    with open(f"{out}.{r}.json") as f:
                        rs.append(json.load(f))
                except (OSError, ValueError):
                    rs.append(None)  # stopped by horovodrun (a peer failed) or the timeout
            ok = rc == 0 and all(r is not None and r["ok"] for r in rs)
            done = [r for r in rs if r is not None]
            unsupported = any(r["unsupported"] for r in done)
            oom = [i for i, r in enumerate(rs) if r is not None and r["oom"]]
            params = max((r["params"] for r in done), default=0)
            peak = max((r["peak"] for r in done), default=0)
            if ok:
                what = "fits" + (f", peak allocated {peak / MB:.0f} MB" if peak else "")
            elif unsupported:
                what = "unsupported"
            elif oom:
                what = f"out of memory on rank(s) {','.join(map(str, oom))}"
            else:
                errs = sorted({r["error"] for r in done if r["error"]})
                what = f"failed (exit code {rc}" + (f"; {errs[0]}" if errs else
                                                    ", no rank reported") + ")"
            print(f"max-depth {lib}: depth {depth} ({params / 1e6:.1f}M parameters): {what} "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
            return ok, unsupported, bool(oom) or ok, params

        for lib in libs:
            # After the unsharded optimizer, start from its depth and grow by 1.25x:
            # sharding gains less than 2x, so doubling would waste trials.
            known = found.get("hvd") if lib != "hvd" else None
            start = max(args.start_depth, known[0] if known else 0)
            grow = 1.25 if known and known[0] >= args.start_depth else args.grow
            lo, lo_params, hi, d, trials, clean = 0, 0, None, start, 0, True
            unsupported = False
            while trials < args.max_trials:
                if hi is not None:
                    if hi - lo <= args.depth_resolution:
                        break
                    d = (lo + hi) // 2
                ok, unsupported, clean_outcome, params = run_trial(lib, d)
                trials += 1
                if unsupported:
                    break
                clean = clean and clean_outcome
                if ok:
                    lo, lo_params = d, params
                    if hi is None:
                        d = max(d + 1, int(d * grow))
                else:
                    hi = d
            if unsupported:
                found[lib] = None
                print(f"max-depth {lib}: skipped, this horovod_torch has no "
                      "shard_optimizer_state", flush=True)
                continue
            found[lib] = (lo, lo_params, hi, trials, clean)

    print(f"\nlargest depth that trains {args.trial_steps} steps, transformer d_model "
          f"{args.d_model}, batch {args.batch_size} x {args.seq_len} per rank, {n} ranks"
          + (f", {_gpu_line()}" if args.device == "cuda" else ", CPU"))
    print("| contender | max depth | parameters | first depth that did not fit | trials |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for lib in libs:
        if found.get(lib) is None:
            print(f"| {lib} | skipped | | | |")
            continue
        lo, lo_params, hi, trials, clean = found[lib]
        exact = hi is not None and hi - lo <= args.depth_resolution
        note = "" if exact else " (stopped by --max-trials)"
        note += "" if clean else " (a failure was not an OOM: see above)"
        print(f"| {lib} | {lo}{note} | {lo_params / 1e6:.1f}M | "
              f"{hi if hi is not None else '-'} | {trials} |")
    if found.get("hvd") and any(found.get(l) for l in libs if l.startswith("hvd-sharded")):
        for lib in libs:
            if lib.startswith("hvd-sharded") and found.get(lib) and found["hvd"][0]:
                print(f"{lib}/hvd max depth: {found[lib][0] / found['hvd'][0]:.2f}x "
                      f"({found[lib][1] / max(found['hvd'][1], 1):.2f}x the parameters)")


def _gpu_line() -> str:
    import torch
    return (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL "
            f"{'.'.join(map(str, torch.cuda.nccl.version()))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--np", type=int, default=0)
    p.add_argument("--contenders", default=None,
                   help=f"comma-separated, of {','.join(ALL_CONTENDERS)} (default: "
                        "hvd,hvd-sharded,ddp-zero; with --max-depth hvd,hvd-sharded)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (8; cpu 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens (512; cpu 32)")
    p.add_argument("--layers", type=int, default=None, help="encoder layers (24; cpu 2)")
    p.add_argument("--d-model", type=int, default=None, help="width (1024; cpu 64)")
    p.add_argument("--warmup", type=int, default=None, help="steps per contender (3; cpu 1)")
    p.add_argument("--iters", type=int, default=None, help="blocks per contender (6; cpu 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per block (10; cpu 2)")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--max-depth", action="store_true",
                   help="find the largest depth that fits instead (one launch per trial)")
    p.add_argument("--max-trials", type=int, default=12, help="per contender")
    p.add_argument("--start-depth", type=int, default=24)
    p.add_argument("--grow", type=float, default=2.0,
                   help="factor between depths until one fails (1.25 for a sharded "
                        "contender that starts from hvd's depth in the same run)")
    p.add_argument("--depth-resolution", type=int, default=1,
                   help="bisect until the bracket is this narrow")
    p.add_argument("--trial-steps", type=int, default=2)
    p.add_argument("--trial-timeout", type=float, default=240,
                   help="seconds before a trial's rank gives up (a hang)")
    p.add_argument("--fake-oom-above", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    cpu = args.device == "cpu"
    for name, gpu_default, cpu_default in [("batch_size", 8, 2), ("seq_len", 512, 32),
                                           ("layers", 24, 2), ("d_model", 1024, 64),
                                           ("warmup", 3, 1), ("iters", 6, 2), ("steps", 10, 2)]:
        if getattr(args, name) is None:
            setattr(args, name, cpu_default if cpu else gpu_default)
    if args.contenders is None:
        args.contenders = "hvd,hvd-sharded" if args.max_depth else "hvd,hvd-sharded,ddp-zero"
    bad = [c for c in args.contenders.split(",") if c not in ALL_CONTENDERS]
    if bad:
        p.error(f"unknown contender(s) {bad}; choose from {ALL_CONTENDERS}")
    if args.worker:
        trial(args) if args.trial else worker(args)
        return
    import torch
    n = args.np or (2 if cpu else torch.cuda.device_count())
    forwarded = ["--device", args.device, "--contenders", args.contenders,
                 "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                 "--d-model", str(args.d_model), "--warmup", str(args.warmup),
                 "--iters", str(args.iters), "--steps", str(args.steps),
                 "--mem-steps", str(args.mem_steps), "--trial-steps", str(args.trial_steps),
                 "--trial-timeout", str(args.trial_timeout),
                 "--fake-oom-above", str(args.fake_oom_above)]
    if args.max_depth:
        max_depth(args, n, forwarded)
        return
    sys.exit(launch_self(__file__, n, [*forwarded, "--layers", str(args.layers)]))


if __name__ == "__main__":
    main()
