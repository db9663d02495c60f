"""Recovery from a worker's death with sharded optimizer state: hvd elastic (in process,
from the last commit) against torchrun + DDP + ZeroRedundancyOptimizer (restart of
every worker, from the last checkpoint), same model, same machine.

    python bench/zero_recovery.py [--mode hvd|torchrun|both] [--np 2] [--kill-step 12]
                                  [--commit-every 5] [--steps 20] [--layers 24]
    python bench/zero_recovery.py --device cpu --np 2      # smoke test, no GPU needed

Model: the ~368M transformer of bench/train_gpu.py (24 x 1024, bf16 autocast, batch 8 x
512 tokens per GPU), torch.optim.AdamW(lr=1e-4). Rank 1 kills itself with os._exit(3)
just before step --kill-step (once: a marker file written just before the exit records
the time of death and keeps it from dying again). The time reported is from the death
to the first training step completed after it (the first rank to complete one), plus
the steps that had to be redone (completed before the death, after the last commit).

- hvd: elastic horovodrun (`--min-np N-1 --max-np N`, a discovery script printing
  localhost:N, `--blacklist-cooldown-range 600 600` so the dead slot is not refilled
  during the measurement) running hvd.DistributedOptimizer(AdamW,
  shard_optimizer_state=True) in hvd.elastic.TorchState(model, opt, step=0) under
  @hvd.elastic.run, state.commit() every --commit-every steps. The survivors restore
  the last commit (rebuilding the dead rank's part of the optimizer state from its
  replica) and go on with N-1 workers in the same processes.
- torchrun: `torchrun --standalone --nproc-per-node N --max-restarts 1` running DDP +
  torch.distributed.optim.ZeroRedundancyOptimizer, checkpointing every --commit-every
  steps the way a user does (opt.consolidate_state_dict(to=0); rank 0 torch.save of
  model, optimizer and step to --ckpt-dir; a barrier). torchrun restarts every worker;
  they load the checkpoint (the model's state before DDP wraps it, then
  opt.load_state_dict on every rank) and go on with N workers.

Each mode runs as a subprocess of this driver, bounded by --timeout seconds (its
process group, and any process it started, killed on timeout). The summary lines at
the end are meant to be pasted into docs/benchmarks.md; the mean step time before the
kill (without the commit / checkpoint steps' saving) is there for context. `--device
cpu` runs a tiny transformer (2 x 64, batch 2 x 32) with gloo for DDP, to check the
script end to end.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

_T0 = time.time()  # this process's start, before torch is imported

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 32000
LR = 1e-4
TAG_VAR = "ZERO_RECOVERY_TAG"  # set in every process a run starts, to find stragglers
WARMUP_STEPS = 2  # steps left out of the mean step time (first allocations, autotuning)


# -- worker side ----------------------------------------------------------------------

def _quiet() -> None:
    import warnings
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
    warnings.filterwarnings("ignore", message=".*device_type of 'cuda'.*")


def _device(args, local_rank: int):
    import torch
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        torch.backends.cudnn.benchmark = True
        return torch.device("cuda", local_rank)
    torch.set_num_threads(1)
    return torch.device("cpu")


def _model(args, dev):
    """The train_gpu.py transformer with --layers encoder layers; another width than
    1024 (the CPU smoke test's) keeps its shape: heads of 64, feed-forward 4 x d_model."""
    import torch
    import torch.nn as nn
    from train_gpu import _build
    torch.manual_seed(0)
    if args.d_model == 1024:
        return _build("transformer", dev, layers=args.layers)
    layer = nn.TransformerEncoderLayer(d_model=args.d_model, nhead=max(1, args.d_model // 64),
                                       dim_feedforward=4 * args.d_model, batch_first=True,
                                       norm_first=True)
    return nn.Sequential(nn.Embedding(VOCAB, args.d_model),
                         nn.TransformerEncoder(layer, args.layers),
                         nn.Linear(args.d_model, VOCAB)).to(dev)


def _data(args, dev):
    import torch
    from train_gpu import _batch
    torch.manual_seed(1)
    data, target = _batch("transformer", args.batch_size, dev)
    return data[:, :args.seq_len].contiguous(), target[:, :args.seq_len].contiguous()


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _die(marker: str) -> None:
    """Rank 1's death: the others have reached this step's collectives meanwhile; the
    time is written just before the exit (renamed into place, so a reader never sees
    a half-written marker)."""
    time.sleep(0.2)
    with open(marker + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.rename(marker + ".tmp", marker)
    os._exit(3)


def _died_at(marker: str) -> float:
    with open(marker) as f:
        return float(f.read() or "nan")


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _steady(times):
    return times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times


def _where(dev, n: int) -> str:
    import torch
    if dev.type == "cuda":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        return (f"gpu={torch.cuda.get_device_name(dev).replace(' ', '_')} n={n} "
                f"torch={torch.__version__} nccl={nccl}")
    return f"gpu=none n={n} torch={torch.__version__} nccl=none"


def hvd_worker(args) -> None:
    import torch
    import horovod.torch as hvd
    from train_gpu import _step
    _quiet()
    hvd.init()
    dev = _device(args, hvd.local_rank())
    model = _model(args, dev)
    data, target = _data(args, dev)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   shard_optimizer_state=True)
    state = hvd.elastic.TorchState(model, opt, step=0)
    if hvd.rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        built = hvd.nccl_built() if dev.type == "cuda" else "none"
        print(f"INFO mode=hvd params={params} {_where(dev, hvd.size())} hvd_nccl={built}",
              flush=True)
    rec = {"high": 0, "reset_at": None, "lost": None, "reported": False, "prekill": False}
    step_times, commit_times, post_times = [], [], []

    def on_reset():
        if rec["reset_at"] is None:  # the first reset: the one after the death
            rec["reset_at"] = time.time()
            rec["lost"] = rec["high"] - state.step  # state.step is the restored commit's

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            if state.step == args.kill_step and rec["reset_at"] is None:
                if hvd.rank() == 0 and not rec["prekill"]:
                    rec["prekill"] = True
                    steady = _steady(step_times)
                    print(f"PREKILL mode=hvd rank=0 size={hvd.size()} "
                          f"step_mean={_mean(steady):.4f} steps={len(steady)} "
                          f"save_mean={_mean(commit_times):.4f} saves={len(commit_times)}",
                          flush=True)
                if hvd.rank() == 1 and not os.path.exists(args.marker):
                    _die(args.marker)
            t = time.perf_counter()
            _step(state.model, opt, data, target, True)
            _sync(dev)
            dt = time.perf_counter() - t
            state.step += 1
            rec["high"] = max(rec["high"], state.step)
            if rec["reset_at"] is None:
                step_times.append(dt)
            elif not rec["reported"]:
                rec["reported"] = True
                died = _died_at(args.marker)
                print(f"RECOVERY mode=hvd rank={hvd.rank()} size={hvd.size()} "
                      f"seconds={time.time() - died:.3f} reformed={rec['reset_at'] - died:.3f} "
                      f"lost={rec['lost']} resumed_at={state.step - 1}", flush=True)
            else:
                post_times.append(dt)
            if state.step % args.commit_every == 0:
                t = time.perf_counter()
                state.commit()
                if rec["reset_at"] is None:
                    commit_times.append(time.perf_counter() - t)

    train(state)
    print(f"DONE mode=hvd rank={hvd.rank()} size={hvd.size()} step={state.step} "
          f"post_step_mean={_mean(_steady(post_times)):.4f}", flush=True)


def torchrun_worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from train_gpu import _step
    _quiet()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restarted = os.path.exists(args.marker)
    dev = _device(args, int(os.environ["LOCAL_RANK"]))
    if dev.type == "cuda":
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")
    model = _model(args, dev)
    data, target = _data(args, dev)
    step, ckpt = 0, None
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        step = ckpt["step"]
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
        del ckpt
    _sync(dev)
    loaded_at = time.time()
    resumed = step
    if rank == 0 and not restarted:
        params = sum(p.numel() for p in model.parameters())
        print(f"INFO mode=torchrun params={params} {_where(dev, world)}", flush=True)
    step_times, save_times, post_times = [], [], []
    reported, ckpt_bytes = False, 0
    while step < args.steps:
        if step == args.kill_step and not restarted:
            if rank == 0:
                steady = _steady(step_times)
                print(f"PREKILL mode=torchrun rank=0 size={world} step_mean={_mean(steady):.4f} "
                      f"steps={len(steady)} save_mean={_mean(save_times):.4f} "
                      f"saves={len(save_times)} ckpt_bytes={ckpt_bytes}", flush=True)
            if rank == 1:
                _die(args.marker)
        t = time.perf_counter()
        _step(ddp, opt, data, target, True)
        _sync(dev)
        dt = time.perf_counter() - t
        step += 1
        if not restarted:
            step_times.append(dt)
        elif not reported:
            reported = True
            died = _died_at(args.marker)
            print(f"RECOVERY mode=torchrun rank={rank} size={world} "
                  f"seconds={time.time() - died:.3f} started={_T0 - died:.3f} "
                  f"loaded={loaded_at - died:.3f} lost={args.kill_step - resumed} "
                  f"resumed_at={resumed}", flush=True)
        else:
            post_times.append(dt)
        if step % args.commit_every == 0:
            t = time.perf_counter()
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                            "step": step}, args.ckpt + ".tmp")
                os.replace(args.ckpt + ".tmp", args.ckpt)
                ckpt_bytes = os.path.getsize(args.ckpt)
            dist.barrier()
            if not restarted:
                save_times.append(time.perf_counter() - t)
    print(f"DONE mode=torchrun rank={rank} size={world} step={step} "
          f"post_step_mean={_mean(_steady(post_times)):.4f}", flush=True)
    dist.destroy_process_group()


# -- driver side ----------------------------------------------------------------------

_LIVE = re.compile(r"INFO mode|PREKILL|RECOVERY|DONE mode|exited with code|lost a peer|"
                   r"generation \d+:|Traceback|Error|error:|[Ff]ailed|restart", re.I)


def _tagged_pids(tag: str):
    """Processes (other than this one) started with TAG_VAR=tag in their environment."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def _stop(proc: subprocess.Popen, tag: str) -> None:
    """Stops a run: SIGTERM to its process group (horovodrun and torchrun stop their
    workers on it), SIGKILL after 15 s, then SIGKILL to anything it started that is
    still there (workers run in process groups of their own)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    time.sleep(0.5)
    for pid in _tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fields(line: str, tag: str):
    i = line.find(tag + " mode=")
    return dict(re.findall(r"(\w+)=(\S+)", line[i:])) if i >= 0 else None


def _worker_args(args, mode: str, work: str):
    return ["--worker", mode, "--device", args.device, "--layers", str(args.layers),
            "--d-model", str(args.d_model), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--steps", str(args.steps),
            "--kill-step", str(args.kill_step), "--commit-every", str(args.commit_every),
            "--marker", os.path.join(work, "died"), "--ckpt", os.path.join(work, "ckpt.pt")]


def run_mode(args, mode: str) -> dict:
    """Runs one mode to the end (or --timeout); returns what its workers reported."""
    work = tempfile.mkdtemp(prefix=f"zero_recovery_{mode}_", dir=args.ckpt_dir)
    tag = uuid.uuid4().hex
    script = os.path.abspath(__file__)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", **{TAG_VAR: tag},
               PYTHONPATH=os.pathsep.join(p for p in [REPO, os.environ.get("PYTHONPATH")] if p))
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    n = args.np
    if mode == "hvd":
        discover = os.path.join(work, "discover.sh")
        with open(discover, "w") as f:
            f.write(f"#!/bin/sh\necho localhost:{n}\n")
        os.chmod(discover, 0o755)
        cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", str(n),
               "--min-np", str(n - 1), "--max-np", str(n), "--host-discovery-script", discover,
               "--blacklist-cooldown-range", "600", "600",
               sys.executable, "-u", script, *_worker_args(args, mode, work)]
    else:
        if not args.torchrun_shared_store:
            # torchrun's agent keeps one TCPStore for every attempt (pytorch#135712): a
            # restarted worker may read the previous attempt's keys (gloo addresses,
            # the NCCL unique id) and fail to connect. A store of their own per attempt.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(n), "--max-restarts", "1",
               script, *_worker_args(args, mode, work)]
    log_path = os.path.join(work, "output.log")
    print(f"\n== {mode}: {' '.join(cmd)}\n   (output in {log_path})", flush=True)
    lines = []
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1, start_new_session=True)

        def pump():
            for line in proc.stdout:
                lines.append(line)
                log.write(line)
                log.flush()
                if args.show_output or _LIVE.search(line):
                    sys.stdout.write(f"   [{mode} +{time.time() - t0:6.1f}s] {line}")
                    sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            print(f"   [{mode}] no end within --timeout {args.timeout:g} s; stopping it",
                  flush=True)
        _stop(proc, tag)  # also any straggler of a run that ended
        rc = proc.returncode
        reader.join(timeout=10)
    res = {"mode": mode, "rc": rc, "timed_out": timed_out, "wall": time.time() - t0,
           "work": work, "log": log_path, "lines": lines, "recoveries": [], "done": []}
    for line in lines:
        for key in ("INFO", "PREKILL"):
            f = _fields(line, key)
            if f is not None and key not in res:
                res[key] = f
        f = _fields(line, "RECOVERY")
        if f is not None:
            res["recoveries"].append(f)
        f = _fields(line, "DONE")
        if f is not None:
            res["done"].append(f)
    res["ok"] = (rc == 0 and not timed_out and bool(res["recoveries"])
                 and all(int(d["step"]) == args.steps for d in res["done"]) and bool(res["done"]))
    if res["ok"] and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        res["log"] = None
    elif os.path.exists(os.path.join(work, "ckpt.pt")) and not args.keep:
        os.remove(os.path.join(work, "ckpt.pt"))  # the log stays, the checkpoint goes
    return res


def _header(args, results) -> str:
    infos = [r["INFO"] for r in results if "INFO" in r]
    if not infos:
        return "zero_recovery: no worker reported its setup"
    info = infos[0]
    params = int(info["params"])
    if info["gpu"] == "none":
        where = f"{args.np} CPU ranks, torch {info['torch']}, gloo for DDP"
    else:
        where = (f"{args.np} x {info['gpu'].replace('_', ' ')}, torch {info['torch']}, NCCL "
                 f"{info['nccl']}")
        built = [i["hvd_nccl"] for i in infos if "hvd_nccl" in i]
        where += f" (hvd built with NCCL code {built[0]})" if built else ""
    return (f"transformer {args.layers} x {args.d_model} ({params / 1e6:.1f}M parameters), "
            f"AdamW lr {LR:g}, bf16 autocast, batch {args.batch_size} x {args.seq_len} per "
            f"rank, on {where}; rank 1 dies (os._exit) before step {args.kill_step} of "
            f"{args.steps}, commit/checkpoint every {args.commit_every} steps")


def _summary(args, r) -> str:
    mode = r["mode"]
    name = ("hvd (sharded, in process)" if mode == "hvd"
            else "torchrun (DDP+ZeroRedundancyOptimizer, restart + checkpoint)")
    why = ("" if r["ok"] else "timed out" if r["timed_out"] else
           f"exit code {r['rc']}" if r["rc"] != 0 else
           "no RECOVERY line" if not r["recoveries"] else "did not finish every step")
    if not r["recoveries"]:
        return f"recovery {name}: FAILED ({why}; log {r['log']})"
    first = min(r["recoveries"], key=lambda f: float(f["seconds"]))
    secs, lost = float(first["seconds"]), int(first["lost"])
    pre = r.get("PREKILL", {})
    step = float(pre.get("step_mean", "nan"))
    save = float(pre.get("save_mean", "nan"))
    after = r["done"][0]["size"] if r["done"] else "?"
    if mode == "hvd":
        detail = (f"job re-formed (hvd.init done) after {float(first['reformed']):.2f} s"
                  f", {args.np} -> {after} workers")
        saves = f"commit every {args.commit_every} steps, {save:.3f} s each"
    else:
        detail = (f"new workers started after {float(first['started']):.2f} s, ready (process "
                  f"group, model, checkpoint loaded) after {float(first['loaded']):.2f} s, "
                  f"{args.np} -> {after} workers"
                  + ("" if args.torchrun_shared_store else
                     ", TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"))
        mb = int(pre.get("ckpt_bytes", "0")) / (1 << 20)
        saves = (f"checkpoint every {args.commit_every} steps, {mb:.0f} MB, save {save:.2f} s "
                 f"each")
    return (f"recovery {name}: {secs:.2f} s from the death to the next completed step "
            f"({detail}); {lost} step{'s' if lost != 1 else ''} redone ({saves}); mean step "
            f"before the kill {step:.3f} s (commit/checkpoint saving not included)"
            + (f"; after the recovery was measured the run {why} (log {r['log']})" if why else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["hvd", "torchrun", "both"], default="both")
    p.add_argument("--np", type=int, default=2, help="workers (GPUs) at the start")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--kill-step", type=int, default=12, help="rank 1 dies before this step")
    p.add_argument("--commit-every", type=int, default=5,
                   help="steps between hvd commits / torchrun checkpoints")
    p.add_argument("--steps", type=int, default=None, help="default: --kill-step + 8")
    p.add_argument("--layers", type=int, default=None, help="encoder layers (24; cpu: 2)")
    p.add_argument("--d-model", type=int, default=None, help="width (1024; cpu: 64)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (8; cpu: 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens (512; cpu: 32)")
    p.add_argument("--ckpt-dir", default=None,
                   help="where each mode's work folder (marker, checkpoint, log) goes "
                        "(default: the temp folder)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mode")
    p.add_argument("--keep", action="store_true", help="keep the work folders (and checkpoint)")
    p.add_argument("--show-output", action="store_true", help="echo all the workers' output")
    p.add_argument("--torchrun-shared-store", action="store_true",
                   help="leave torchrun's store shared across restarts (its default; see "
                        "pytorch#135712): without this, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    p.add_argument("--worker", choices=["hvd", "torchrun"], help=argparse.SUPPRESS)
    p.add_argument("--marker", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    cpu = args.device == "cpu"
    for name, gpu_default, cpu_default in [("layers", 24, 2), ("d_model", 1024, 64),
                                           ("batch_size", 8, 2), ("seq_len", 512, 32)]:
        if getattr(args, name) is None:
            setattr(args, name, cpu_default if cpu else gpu_default)
    if args.steps is None:
        args.steps = args.kill_step + 8
    if args.worker == "hvd":
        hvd_worker(args)
        return
    if args.worker == "torchrun":
        torchrun_worker(args)
        return
    if args.np < 2:
        p.error("--np must be at least 2 (rank 1 dies)")
    if not 0 < args.kill_step < args.steps:
        p.error("need 0 < --kill-step < --steps")
    if args.commit_every < 1:
        p.error("--commit-every must be at least 1")
    if args.seq_len > 512:
        p.error("--seq-len is at most 512 (train_gpu._batch's)")
    modes = ["hvd", "torchrun"] if args.mode == "both" else [args.mode]
    results = [run_mode(args, m) for m in modes]
    print("\n" + _header(args, results))
    for r in results:
        print(_summary(args, r))
        if not r["ok"]:
            sys.stdout.write("   last lines of its output:\n" +
                             "".join("   | " + line for line in r["lines"][-40:]))
    sys.stdout.flush()
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
