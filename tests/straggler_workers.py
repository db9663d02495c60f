"""Workers of tests/test_stragglers.py: a small data-parallel training loop in which one
rank may be made slow (a sleep in its step, as a starved data loader would be)."""
import time

import torch

import horovod_torch as hvd


def _setup(device: str):
    """hvd.init(), this rank's device, and a small model under DistributedOptimizer with
    its fixed batch; on "cuda" also the GPU's cycles per millisecond (torch.cuda._sleep)."""
    hvd.init()
    dev, cycles_per_ms = torch.device("cpu"), 0
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
        dev = torch.device("cuda", hvd.local_rank())
        cycles_per_ms = torch.cuda.get_device_properties(dev).clock_rate
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    return dev, cycles_per_ms, model, opt, torch.randn(16, 32, device=dev)


def _step(model, opt, x) -> None:
    """One training step; on a GPU the loss is read, as a script that logs it does."""
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    if x.is_cuda:
        loss.item()


def _final_report(**named) -> None:
    """Waits for the last report (it reaches every rank within about a second of the
    last sample), prints it after `named`, and shuts down."""
    time.sleep(1.5)
    hvd.allreduce(torch.zeros(1), name="straggler.flush")
    report = hvd.straggler_report()
    print(f"FINAL rank={hvd.rank()} " + "".join(f"{k}={v} " for k, v in named.items()) +
          f"straggler={report.straggler} samples={report.samples} cycles={report.cycles}",
          flush=True)
    print(report, flush=True)
    hvd.shutdown()


def train(slow_rank: str, delay_ms: str, steps: str, compute_ms: str = "2",
          device: str = "cpu") -> None:
    """Trains for `steps` steps; rank `slow_rank` (-1: none) is `delay_ms` slower in each
    step, every rank takes `compute_ms`. On "cpu" the slow rank sleeps; on "cuda" its GPU
    is kept busy that long (extra work on its stream) and every rank reads its loss each
    step, as a script that logs it does. Prints the step at which this rank's report
    first named a straggler, and the last report."""
    dev, cycles_per_ms, model, opt, x = _setup(device)
    slow, delay, compute = int(slow_rank), float(delay_ms) / 1e3, float(compute_ms) / 1e3
    named_at, named = None, None
    for step in range(int(steps)):
        if hvd.rank() == slow:
            if dev.type == "cuda":
                torch.cuda._sleep(int(cycles_per_ms * delay * 1e3))
            else:
                time.sleep(delay)
        time.sleep(compute)
        _step(model, opt, x)
        report = hvd.straggler_report()
        if named_at is None and report.straggler is not None:
            named_at, named = step, report.straggler
    _final_report(named_at=named_at, named=named)


def join_tail(join_step: str, steps: str, busy_ms: str) -> None:
    """On GPUs: rank 1 calls hvd.join() after `join_step` steps, the others train
    `steps`, their GPUs busy `busy_ms` in each. Rank 1's engine then runs their
    allreduces with zeros, which wait inside NCCL for the others' inputs: its collectives
    take longest, so GPU times compared beside a join would name a rank still training.
    Prints what this rank's report named, as train() does."""
    _, cycles_per_ms, model, opt, x = _setup("cuda")
    named = None
    for _ in range(int(join_step) if hvd.rank() == 1 else int(steps)):
        torch.cuda._sleep(int(cycles_per_ms * float(busy_ms)))
        _step(model, opt, x)
        if named is None:
            named = hvd.straggler_report().straggler
    hvd.join()
    _final_report(named=named)
