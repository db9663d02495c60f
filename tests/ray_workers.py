"""Functions that tests/test_ray.py runs in Ray actors (imported there by Ray, so
kept free of pytest and of the test module's fixtures)."""
import os
import time


def rank_size_sum(scale):
    """hvd.init(), then an allreduce of rank+1 (Sum) times ``scale``."""
    import torch

    import horovod.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), total * scale


def straggler(slow_rank, delay_s, steps):
    """A small training loop in which rank ``slow_rank`` sleeps ``delay_s`` per step;
    returns this worker's hvd.straggler_report() after it (named rank, that rank's
    host, samples)."""
    import time

    import torch

    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    model, x, y = _model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        if hvd.rank() == slow_rank:
            time.sleep(delay_s)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    time.sleep(1.5)  # the coordinator sends its report about once a second
    hvd.allreduce(torch.zeros(1), name="straggler.flush")
    report = hvd.straggler_report()
    named = report.straggler
    return named, None if named is None else report.ranks[named].host, report.samples


class Counter:
    """A stateful executable: each worker keeps its own count."""

    def __init__(self, start):
        import horovod.torch as hvd
        hvd.init()
        self.count = start
        self.rank = hvd.rank()

    def add(self, n):
        import torch

        import horovod.torch as hvd
        self.count += n
        # every worker's count, summed across the job
        return hvd.allreduce(torch.tensor([float(self.count)]), op=hvd.Sum).item()


def log_rank(counter):
    """Sends the worker's rank to the driver's callbacks."""
    from horovod.ray import ray_logger
    ray_logger.log({"rank": counter.rank})


def fail_on_rank(bad_rank, others_wait_s=0.0):
    """Raises on ``bad_rank``; the others wait ``others_wait_s`` (so that the bad
    rank has shut its engine down by then), call hvd.init() and allreduce."""
    import os
    import time

    import torch

    import horovod.torch as hvd
    if int(os.environ["HOROVOD_RANK"]) != bad_rank:
        time.sleep(others_wait_s)
    hvd.init()
    if hvd.rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} refuses")
    return hvd.allreduce(torch.ones(1)).item()


def _model_and_data():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.25
    return model, x, y


def train(steps, out_dir=None, step_sleep=0.0, elastic=True, stop_file=None, slow_node=None,
          slow_s=0.0):
    """SGD on a fixed full batch, gradients averaged by the DistributedOptimizer:
    every worker computes the same gradient, so the weights after N steps are the
    same at any world size (and with any number of resets, if no committed step is
    lost or repeated). With ``out_dir`` each worker appends ``step rank size step time``
    after every commit, and ``reset rank size step time`` after each reset (the
    step it resumes from), to ``<out_dir>/<actor name>.log``. Training stops at
    ``steps``, or on every rank at once once ``stop_file`` exists. A worker on the Ray
    node ``slow_node`` sleeps ``slow_s`` more per step (a straggler)."""
    import torch

    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    model, x, y = _model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    log = None
    if out_dir:
        import ray
        name = ray.get_runtime_context().get_actor_name() or f"pid{os.getpid()}"
        log = open(os.path.join(out_dir, name + ".log"), "a")

    def step_once():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    if not elastic:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for _ in range(steps):
            step_once()
        return dict(step=steps, size=hvd.size(),
                    weights=[p.detach().flatten().tolist() for p in model.parameters()])

    state = hvd.elastic.TorchState(model, opt, step=0)

    if slow_node is not None:
        import ray
        if ray.get_runtime_context().get_node_id() == slow_node:
            step_sleep += slow_s

    def write(kind):
        if log is not None:
            log.write(f"{kind} {hvd.rank()} {hvd.size()} {state.step} {time.time():.6f}\n")
            log.flush()

    state.register_reset_callbacks([lambda: write("reset")])

    def stop_now():
        if stop_file is None:
            return False
        flag = torch.tensor([float(os.path.exists(stop_file))])
        return hvd.allreduce(flag, op=hvd.Max, name="stop").item() > 0

    @hvd.elastic.run
    def loop(state):
        while state.step < steps and not stop_now():
            step_once()
            state.step += 1
            if step_sleep:
                time.sleep(step_sleep)
            state.commit()
            write("step")

    loop(state)
    return dict(step=state.step, size=hvd.size(), rank=hvd.rank(),
                weights=[p.detach().flatten().tolist() for p in model.parameters()])
