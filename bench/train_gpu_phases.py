"""Where a training step of the ~350M transformer (bench/train_gpu.py) spends its time,
per library: forward, backward (host side and with the GPU), synchronize() and the rest
of step(), each phase closed by a CUDA synchronize; then free-running steps; and the
CPU time spent in hvd's gradient hooks (DistributedOptimizer._start).

    LIBS=hvd,hvd16,ddp,none python bench/train_gpu_phases.py NP

hvd16: hvd with Compression.fp16; none: no communication. Rank 0 prints one line per
library (medians over 10 steps after 3 warm-up steps).
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import launch_self

def worker():
    import torch, torch.distributed as dist, torch.nn.functional as F
    import horovod_torch as hvd
    from train_gpu import _build, _sgd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                            rank=hvd.rank(), world_size=hvd.size(), device_id=dev)
    data = torch.randint(0, 32000, (8, 512), device=dev)
    target = torch.randint(0, 32000, (8, 512), device=dev)
    hook_t = [0.0, 0]
    res = {}
    for lib in os.environ.get("LIBS", "hvd,hvd16").split(","):
        torch.manual_seed(0)
        model = _build("transformer", dev)
        opt = _sgd("transformer", model)
        net = model
        if lib.startswith("hvd"):
            comp = hvd.Compression.fp16 if lib == "hvd16" else hvd.Compression.none
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
            orig = opt._start
            def timed(p, orig=orig):
                t = time.perf_counter(); orig(p); hook_t[0] += time.perf_counter() - t; hook_t[1] += 1
            opt._start = timed
        elif lib == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
        ph = {"fwd": [], "bwd": [], "step": [], "total": [], "free": []}
        for it in range(13):
            hook_t[0] = 0; hook_t[1] = 0
            dist.barrier(); torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = net(data)
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
            torch.cuda.synchronize(); t1 = time.perf_counter()
            loss.backward()
            t2c = time.perf_counter()
            torch.cuda.synchronize(); t2 = time.perf_counter()
            if lib.startswith("hvd"):
                opt.synchronize(); t25 = time.perf_counter(); torch.cuda.synchronize(); t26 = time.perf_counter()
                with opt.skip_synchronize(): opt.step()
            else:
                opt.step(); t25 = t26 = time.perf_counter()
            torch.cuda.synchronize(); t3 = time.perf_counter()
            if it >= 3:
                ph["fwd"].append(t1 - t0); ph["bwd"].append(t2 - t1); ph["step"].append(t3 - t2)
                ph["total"].append(t3 - t0); ph["free"].append(t2c - t1)
                ph.setdefault("sync_cpu", []).append(t25 - t2); ph.setdefault("sync_gpu", []).append(t26 - t25)
        # free-running (no syncs) 10 steps
        dist.barrier(); torch.cuda.synchronize(); t0 = time.perf_counter()
        for it in range(10):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = net(data)
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
            loss.backward()
            if lib.startswith("hvd"):
                opt.synchronize()
                with opt.skip_synchronize(): opt.step()
            else:
                opt.step()
        torch.cuda.synchronize(); free = (time.perf_counter() - t0) / 10
        m = {k: statistics.median(v) * 1e3 for k, v in ph.items()}
        if hvd.rank() == 0:
            print(f"{lib:5} fwd {m['fwd']:.1f} bwd {m['bwd']:.1f} (cpu-side {m['free']:.1f}) step {m['step']:.1f} "
                  f"(synchronize cpu {m['sync_cpu']:.1f} gpu {m['sync_gpu']:.1f}) total {m['total']:.1f} ms; free-running {free*1e3:.1f} ms/step; "
                  f"hook calls {hook_t[1]} cpu {hook_t[0]*1e3:.1f} ms", flush=True)
        del model, net, opt
        torch.cuda.empty_cache()
    dist.destroy_process_group(); hvd.shutdown()

if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        sys.exit(launch_self(os.path.abspath(__file__), int(sys.argv[1]), []))
