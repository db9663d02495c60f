"""A horovod_torch training function run by pyspark's ``TorchDistributor`` (which
starts ``torchrun``): ``hvd.init()`` understands torchrun's variables, so the script
needs no change. On a laptop:

    python examples/spark/torch_distributor.py

``local_mode=True`` runs torchrun on the driver; on a cluster, ``local_mode=False``
runs it in Spark tasks (then pyspark also needs pandas and pyarrow).
"""
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(steps, lr):
    import torch
    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                         named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(100 + hvd.rank())  # each rank its own data
    for step in range(steps):
        x = torch.randn(32, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    print(f"rank {hvd.rank()} of {hvd.size()}: final loss {loss.item():.4f}", flush=True)
    # the same on every rank: TorchDistributor returns one rank's value (the last written)
    return [p.detach() for p in model.parameters()]


def main():
    # Run from a checkout whose extension is built in place (`make build`): this script
    # and the executors it starts import horovod_torch from it. An unbuilt checkout
    # would hide an installed horovod_torch, so it is left off the path.
    if glob.glob(os.path.join(ROOT, "horovod_torch", "_C*.so")):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        sys.path.insert(0, ROOT)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors' Python
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[2]").appName("TorchDistributor").getOrCreate()
    try:
        params = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
            train, 50, 0.05)
        print("trained parameters:", params)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
