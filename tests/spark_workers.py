"""Functions that tests/test_spark.py runs on Spark (horovod_torch.spark.run) and
through pyspark's TorchDistributor. Kept light: imported by every rank."""
import os
import time

DIM, ROWS, STEPS, LR = 4, 16, 5, 0.1


def data():
    """A fixed regression problem: every rank builds the same full batch."""
    import torch
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(ROWS, DIM, generator=g)
    y = x @ torch.arange(1.0, DIM + 1).unsqueeze(1) + 0.5
    return x, y


def sgd_reference(steps=STEPS):
    """One process, the whole batch: what the ranks must reach together."""
    import torch
    x, y = data()
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train(steps=STEPS):
    """Each rank trains on its contiguous shard of the batch with DistributedOptimizer;
    returns (rank, size, parameters), after checking all ranks hold the same ones."""
    import torch
    import horovod_torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = data()
    shard = ROWS // size
    x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    for p in params:  # every rank holds the same parameters
        gathered = hvd.allgather(p.unsqueeze(0))
        assert torch.equal(gathered[0], gathered[-1]), "ranks disagree"
    return rank, size, params


def topology(tag):
    import torch
    import horovod_torch as hvd
    hvd.init()
    print(f"hello from rank {hvd.rank()}", flush=True)
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                local_size=hvd.local_size(), cross_rank=hvd.cross_rank(),
                cross_size=hvd.cross_size(), total=total, tag=tag,
                env=os.environ.get("SPARK_TEST_VAR"), pid=os.getpid())


def fail(bad_rank, how, others, pid_dir):
    """Rank `bad_rank` fails (how="raise": an exception; "exit": os._exit(3);
    "kill_task": its Spark task's Python worker is killed); the
    others wait in allreduces (others="collective") or sleep ("sleep") until stopped."""
    import torch
    import horovod_torch as hvd
    hvd.init()
    with open(os.path.join(pid_dir, f"rank{hvd.rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if hvd.rank() == bad_rank:
        time.sleep(0.5)
        if how == "exit":
            os._exit(3)
        if how == "kill_task":  # the Spark task's Python worker dies
            import signal
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(60)
        raise ValueError(f"boom in rank {hvd.rank()}")
    if others == "sleep":
        time.sleep(600)
    while True:
        hvd.allreduce(torch.ones(1), name="wait")
