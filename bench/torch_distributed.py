"""The torch.distributed backend "hvd" against gloo (CPU) or NCCL (CUDA): the same
processes hold both groups (the default group on "hvd", a second one over the same
ranks on the peer), and each measurement alternates between them.

    python bench/torch_distributed.py --np 2 [--device cpu|cuda] [--rounds 3]
        [--sizes 4K,64K,1M,16M,64M] [--ddp-steps 30] [--model mlp|resnet50] [--batch N]
        [--width W] [--fsdp2-layers L [--fsdp2-width D --fsdp2-tokens T]] [--profile DIR]
        [--cuda-direct 0|1]

Prints, per message size, dist.all_reduce's median time on each backend, and a DDP
training step's median time (a 4-layer MLP, width 1024 (4 M parameters) and batch 8
by default, or ResNet-50, batch 64); the ratio is peer / hvd (above 1: hvd is faster).
With --fsdp2-layers L, also a training step of an L-layer transformer (width D, T tokens
per rank; bf16 autocast on CUDA) under FSDP2's fully_shard (each layer and the whole),
on a device mesh over each group, and on CUDA the peak of allocated memory over the timed
steps above what was allocated before them (torch's caching allocator: hvd's fusion
buffer counts, NCCL's own buffers do not).
With --profile DIR, rank 0 also profiles 3 FSDP2 steps on each backend (torch.profiler,
CPU and CUDA): it prints the top operators by self CUDA and self CPU time, and writes
the traces as DIR/fsdp2_<backend>.json.gz.
--cuda-direct 0 runs hvd's CUDA calls as the engine's ops (HOROVOD_C10D_CUDA_DIRECT=0).
"""
import argparse
import gzip
import os
import shutil
import statistics
import subprocess
import sys
import time

from _launch import REPO, free_port


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def launch(a) -> None:
    port = free_port()
    procs = []
    for rank in range(a.np):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        env.update(RANK=str(rank), WORLD_SIZE=str(a.np), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   NCCL_NVLS_ENABLE="0", HOROVOD_C10D_CUDA_DIRECT=a.cuda_direct,
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]],
                                      env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"workers exited with {codes}")


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    import horovod_torch.torch_distributed  # noqa: F401  (registers "hvd")
    rank = int(os.environ["RANK"])
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("hvd")
    peer_name = "nccl" if cuda else "gloo"
    groups = {"hvd": None, peer_name: dist.new_group(backend=peer_name)}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, iters):
        dist.barrier(group=groups[peer_name])
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - start) / iters

    def say(line):
        if rank == 0:
            print(line, flush=True)

    say(f"# {a.np} ranks on {dev.type}; hvd against {peer_name}; medians of {a.rounds} "
        "alternating rounds")
    say(f"{'all_reduce':>12} {'hvd us':>10} {peer_name + ' us':>10} {'ratio':>7}")
    for text in a.sizes.split(","):
        n = max(1, _size(text) // 4)
        x = torch.ones(n, device=dev)
        iters = max(5, min(500, (64 << 20) // (n * 4) // 4))
        times = {k: [] for k in groups}
        for _ in range(a.rounds):
            for name, group in groups.items():
                timed(lambda: dist.all_reduce(x, group=group), 2)  # warm-up
                times[name].append(timed(lambda: dist.all_reduce(x, group=group), iters))
        ours, peer = statistics.median(times["hvd"]), statistics.median(times[peer_name])
        say(f"{text:>12} {ours * 1e6:>10.1f} {peer * 1e6:>10.1f} {peer / ours:>7.2f}")

    from torch.nn.parallel import DistributedDataParallel as DDP
    if a.model == "resnet50":
        import torchvision

        def model():
            torch.manual_seed(0)
            return torchvision.models.resnet50().to(dev)
        data = torch.randn(a.batch or 64, 3, 224, 224, device=dev)
        target = torch.randint(0, 1000, (a.batch or 64,), device=dev)
        loss_fn = torch.nn.functional.cross_entropy
    else:
        def model():
            torch.manual_seed(0)
            w = a.width
            layers = [m for _ in range(3) for m in (torch.nn.Linear(w, w), torch.nn.ReLU())]
            return torch.nn.Sequential(*layers, torch.nn.Linear(w, w)).to(dev)
        data = torch.randn(a.batch or 8, a.width, device=dev)
        target = torch.randn(a.batch or 8, a.width, device=dev)
        loss_fn = torch.nn.functional.mse_loss
    ddps = {name: DDP(model(), process_group=group) for name, group in groups.items()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in ddps.items()}

    def step(name):
        opts[name].zero_grad()
        loss_fn(ddps[name](data), target).backward()
        opts[name].step()

    times = {k: [] for k in groups}
    for _ in range(a.rounds):
        for name in groups:
            timed(lambda: step(name), 3)
            times[name].append(timed(lambda: step(name), a.ddp_steps))
    ours, peer = statistics.median(times["hvd"]), statistics.median(times[peer_name])
    what = f"mlp width {a.width}" if a.model == "mlp" else a.model
    say(f"DDP {what} batch {data.shape[0]} step: hvd {ours * 1e3:.2f} ms, {peer_name} "
        f"{peer * 1e3:.2f} ms, ratio {peer / ours:.2f}")
    if a.fsdp2_layers:
        fsdp2(a, dev, groups, timed, say)
    dist.destroy_process_group()


def fsdp2(a, dev, groups, timed, say) -> None:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    cuda = dev.type == "cuda"
    d, tokens = a.fsdp2_width, a.fsdp2_tokens
    seq = min(512, tokens)
    x = torch.randn(max(1, tokens // seq), seq, d, device=dev)
    models, opts = {}, {}
    for name, group in groups.items():
        mesh = DeviceMesh.from_group(group if group is not None else
                                     torch.distributed.group.WORLD, dev.type)
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        model = torch.nn.TransformerEncoder(layer, a.fsdp2_layers, enable_nested_tensor=False)
        model = model.to(dev)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models[name] = model
        opts[name] = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks = {}

    def step(name):
        opts[name].zero_grad()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = models[name](x).float().square().mean()
        loss.backward()
        opts[name].step()

    times = {k: [] for k in groups}
    for _ in range(a.rounds):
        for name in groups:
            timed(lambda: step(name), 2)
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            times[name].append(timed(lambda: step(name), a.ddp_steps))
            if cuda:
                peak = (torch.cuda.max_memory_allocated() - before) / 2**20
                peaks[name] = max(peaks.get(name, 0.0), peak)
    if a.profile:
        profile(a, groups, step, say)
    names = list(groups)
    ours, peer = statistics.median(times["hvd"]), statistics.median(times[names[1]])
    mem = (f"; peak memory hvd {peaks['hvd']:.0f} MiB, {names[1]} "
           f"{peaks[names[1]]:.0f} MiB" if cuda else "")
    params = sum(p.numel() for p in models["hvd"].parameters()) / 1e6  # DTensor: global
    say(f"FSDP2 transformer {a.fsdp2_layers} x {d} ({params:.1f} M parameters), {tokens} tokens "
        f"per rank, step: hvd {ours * 1e3:.2f} ms, {names[1]} {peer * 1e3:.2f} ms, ratio "
        f"{peer / ours:.2f}{mem}")


def profile(a, groups, step, say) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    import torch.distributed as dist
    rank = dist.get_rank()
    os.makedirs(a.profile, exist_ok=True)
    for name in groups:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                         else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                step(name)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        if rank != 0:
            continue
        events = prof.key_averages()
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            say(f"# FSDP2 profile, {name}, 3 steps, by {key}")
            say(events.table(sort_by=key, row_limit=18, max_name_column_width=60))
        path = os.path.join(a.profile, f"fsdp2_{name}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    p.add_argument("--ddp-steps", type=int, default=30)
    p.add_argument("--model", choices=("mlp", "resnet50"), default="mlp")
    p.add_argument("--batch", type=int, default=0, help="per rank (0: the model's default)")
    p.add_argument("--width", type=int, default=1024, help="the MLP's width (4 layers)")
    p.add_argument("--fsdp2-layers", type=int, default=0,
                   help="also FSDP2 on a transformer of this many layers (0: not)")
    p.add_argument("--fsdp2-width", type=int, default=256)
    p.add_argument("--fsdp2-tokens", type=int, default=512, help="per rank")
    p.add_argument("--profile", default="", help="profile FSDP2 into this folder (rank 0)")
    p.add_argument("--cuda-direct", choices=("0", "1"), default="1",
                   help="HOROVOD_C10D_CUDA_DIRECT for hvd: 1 (default) the group's own NCCL "
                   "communicator, 0 the engine's ops")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
    else:
        launch(a)


if __name__ == "__main__":
    main()
