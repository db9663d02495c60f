"""Data-parallel training on Ray actors with horovod_torch (a script written for
``horovod.ray`` runs as it is: ``from horovod.ray import RayExecutor``).

    python examples/ray/ray_train.py                     # a local Ray with 2 CPUs
    python examples/ray/ray_train.py --num-workers 3 --address auto   # a running cluster

Shows both styles of Horovod's RayExecutor: ``run`` (a function on every worker,
values back in rank order) and ``execute`` on stateful workers (an object made in
each actor by ``start(executable_cls=...)`` that keeps its model between calls).
"""
import argparse

import ray
import torch
import torch.nn as nn

from horovod.ray import RayExecutor


def make_data(seed=0, n=256):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = (x @ torch.linspace(-1, 1, 8).unsqueeze(1)) + 0.1 * torch.randn(n, 1, generator=gen)
    return x, y


def train_fn(epochs, lr):
    """Runs on every worker: each rank trains on its shard; returns its last loss."""
    import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    x, y = make_data()
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]  # this rank's shard
    model = nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(epochs):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    avg = hvd.allreduce(loss.detach(), name="loss").item()
    return hvd.rank(), hvd.size(), avg


class Trainer:
    """A stateful worker: made once in each actor, used by every execute()."""

    def __init__(self, lr):
        import horovod.torch as hvd
        hvd.init()
        self.hvd = hvd
        torch.manual_seed(0)
        x, y = make_data()
        self.x, self.y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
        self.model = nn.Linear(8, 1)
        self.opt = hvd.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=lr),
                                            named_parameters=self.model.named_parameters())
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)

    def epoch(self):
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return self.hvd.allreduce(loss.detach(), name="loss").item()

    def weights(self):
        return self.model.weight.detach().flatten().tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--address", default=None,
                        help="a Ray cluster to join (default: start a local one)")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False)

    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=args.num_workers, cpus_per_worker=1)

    # 1) stateless: run a function on every worker
    executor.start()
    for rank, size, loss in executor.run(train_fn, kwargs=dict(epochs=args.epochs, lr=args.lr)):
        print(f"run: rank {rank}/{size} final loss {loss:.4f}")
    executor.shutdown()

    # 2) stateful: a Trainer in every worker, driven epoch by epoch from here
    executor.start(executable_cls=Trainer, executable_kwargs=dict(lr=args.lr))
    for epoch in range(args.epochs):
        losses = executor.execute(lambda trainer: trainer.epoch())
        if epoch % 10 == 0 or epoch == args.epochs - 1:
            print(f"execute: epoch {epoch} loss {losses[0]:.4f}")
    weights = executor.execute(lambda trainer: trainer.weights())
    assert all(w == weights[0] for w in weights), "replicas diverged"
    print("rank 0 weights:", [round(v, 3) for v in executor.execute_single(
        lambda trainer: trainer.weights())])
    executor.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
