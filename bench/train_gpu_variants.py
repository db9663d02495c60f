"""Ways to communicate the gradients of the ~350M transformer (bench/train_gpu.py), all
built in the same processes and timed in interleaved blocks of 5 steps (the first of
each round rotating): ms per step, median over blocks, slowest rank, then every block.

    LIBS=hvd,ddp,none,late,hvd16,hvdb25 ROUNDS=8 python bench/train_gpu_variants.py NP

hvd: DistributedOptimizer (a hook per gradient); ddp: DistributedDataParallel; none: no
communication; late: no hooks, one grouped allreduce of every gradient after backward;
hvd16: hvd with Compression.fp16; hvdbN: hvd whose hooks only collect gradients and
submit them in batches of N MB (an experiment, not a library feature).
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
    libs = os.environ.get("LIBS", "hvd,ddp,none,late").split(",")
    setups = {}
    for lib in libs:
        torch.manual_seed(0)
        model = _build("transformer", dev)
        opt = _sgd("transformer", model)
        net = model
        if lib.startswith("hvd"):
            comp = hvd.Compression.fp16 if lib == "hvd16" else hvd.Compression.none
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
            if lib.startswith("hvdb"):
                bucket = int(lib[4:] or "25") << 20
                from horovod_torch.submit import _submit
                from horovod_torch import _C
                pend = []; nb = [0]
                def flush(o=opt, pend=pend, nb=nb):
                    if not pend: return
                    grads = [q.grad for q in pend]
                    hs = _submit(_C.OP_ALLREDUCE, grads, grads, [o._wire_names[q] for q in pend],
                                 op=hvd.Average)
                    for q, h, g in zip(pend, hs, grads): o._handles[q] = (h, None, g)
                    pend.clear(); nb[0] = 0
                def start(p, pend=pend, nb=nb, flush=flush):
                    pend.append(p); nb[0] += p.grad.numel() * 4
                    if nb[0] >= bucket: flush()
                opt._start = start
                orig_sync = opt.synchronize
                def sync(orig_sync=orig_sync, flush=flush):
                    flush(); orig_sync()
                opt.synchronize = sync
        elif lib == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
        setups[lib] = (model, net, opt)

    def step(lib):
        model, net, opt = setups[lib]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(data)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        loss.backward()
        if lib == "late":
            hvd.grouped_allreduce_([p.grad for p in model.parameters()], op=hvd.Average, name="late")
        opt.step()

    for lib in libs:
        for _ in range(4): step(lib)
    torch.cuda.synchronize()
    times = {l: [] for l in libs}
    for rnd in range(int(os.environ.get("ROUNDS", "6"))):
        order = libs[rnd % len(libs):] + libs[:rnd % len(libs)]
        for lib in order:
            dist.barrier(); torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(5): step(lib)
            torch.cuda.synchronize()
            times[lib].append((time.perf_counter() - t0) / 5)
    med = {l: torch.tensor([statistics.median(v)], dtype=torch.float64, device=dev) for l, v in times.items()}
    for v in med.values(): dist.all_reduce(v, op=dist.ReduceOp.MAX)
    if hvd.rank() == 0:
        print(f"{hvd.size()} GPUs, ms/step (median of blocks, slowest rank): " +
              ", ".join(f"{l} {med[l].item()*1e3:.1f}" for l in libs), flush=True)
        print("  all blocks: " + "; ".join(f"{l}: " + " ".join(f"{x*1e3:.0f}" for x in v) for l, v in times.items()), flush=True)
    dist.destroy_process_group(); hvd.shutdown()

if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        sys.exit(launch_self(os.path.abspath(__file__), int(sys.argv[1]), []))
