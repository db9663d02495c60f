"""Cost of ``hvd.elastic.TorchState(model, optimizer).commit()`` for a torchvision
ResNet-50 on CPU, against one training step (forward + backward + step).

    python bench/elastic_commit.py [--batch-size 32] [--repeats 10] [--steps 3]

Runs as a single process: ``hvd.init()`` makes a world of one and, with
HOROVOD_ELASTIC unset, commit() = save() + a check_host_updates() that returns at
once. For SGD with momentum and for Adam (each after one training step, so the
optimizer state exists) it prints the median commit() and save() times, the median
training step time with ``hvd.DistributedOptimizer`` at the given batch size, and
commit / step. Batch size 0 (the default) picks 32, or 8 when a step at 32 would take
longer than 10 s.
"""
import argparse
import os
import statistics
import sys
import time

for _var in ("HOROVOD_ELASTIC", "HOROVOD_RANK", "HOROVOD_SIZE"):
    os.environ.pop(_var, None)  # a world of one, not elastic

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

import horovod_torch as hvd  # noqa: E402


def _median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _make(opt_name: str, lr: float):
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr * 0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return model, opt


def _state_mb(model, opt) -> float:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return n / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=0, help="0: 32, or 8 if 32 is too slow")
    p.add_argument("--repeats", type=int, default=20, help="commit()/save() calls timed")
    p.add_argument("--steps", type=int, default=3, help="training steps timed (after 1 warm-up)")
    p.add_argument("--optimizers", default="sgd,adam", help="comma list of sgd, adam")
    args = p.parse_args()
    opt_names = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    if not opt_names or any(o not in ("sgd", "adam") for o in opt_names):
        p.error("--optimizers takes sgd and/or adam")

    hvd.init()
    assert hvd.size() == 1

    gen = torch.Generator().manual_seed(0)

    def batch(n):
        return (torch.randn(n, 3, 224, 224, generator=gen),
                torch.randint(0, 1000, (n,), generator=gen))

    def train_step(model, opt, data):
        x, y = data
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    rows = []
    bs = args.batch_size
    for name in opt_names:
        model, opt = _make(name, 0.01)
        model.train()
        if bs == 0:  # probe at 8 with the warm-up step: 4x that must fit in 10 s
            start = time.perf_counter()
            train_step(model, opt, batch(8))
            probe = time.perf_counter() - start
            bs = 32 if 4 * probe <= 10.0 else 8
            print(f"(a batch-8 step took {probe:.1f} s; using batch {bs})", flush=True)
        data = batch(bs)
        train_step(model, opt, data)  # warm-up at the final size; optimizer state now exists
        assert opt.state, "optimizer state should exist after one step"

        start = time.perf_counter()
        state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0)
        init_ms = (time.perf_counter() - start) * 1e3
        state.commit()  # first commit after construction (warm)
        commit_t, save_t = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            commit_t.append(_median_ms(state.commit, 1))
            save_t.append(_median_ms(state.save, 1))
        commit_ms, save_ms = statistics.median(commit_t), statistics.median(save_t)
        step_ms = _median_ms(lambda: train_step(model, opt, data), args.steps)
        rows.append((name, _state_mb(model, opt), init_ms, commit_ms, save_ms, step_ms))
        del state, model, opt

    print(f"\nelastic TorchState.commit() vs one training step, ResNet-50, batch {bs}, "
          f"1 process (torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}); "
          f"medians of {args.repeats} commits/saves and "
          f"{args.steps} steps")
    print(f"{'optimizer':>9} {'state MB':>9} {'init ms':>8} {'commit ms':>10} {'save ms':>8} "
          f"{'step ms':>9} {'commit/step':>12}")
    for name, mb, init_ms, commit_ms, save_ms, step_ms in rows:
        label = "SGD+mom" if name == "sgd" else "Adam"
        print(f"{label:>9} {mb:9.0f} {init_ms:8.1f} {commit_ms:10.1f} {save_ms:8.1f} "
              f"{step_ms:9.0f} {100 * commit_ms / step_ms:11.2f}%")
    sys.stdout.flush()
    hvd.shutdown()


if __name__ == "__main__":
    main()
