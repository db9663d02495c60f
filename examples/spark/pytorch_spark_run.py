"""Train a small PyTorch model with horovod_torch on Spark (Horovod's
``horovod.spark.run``), on a laptop:

    python examples/spark/pytorch_spark_run.py                 # local[2], 2 ranks
    python examples/spark/pytorch_spark_run.py --master local[4] --num-proc 4

Needs pyspark (and Java 17+). Each rank runs ``train`` in a Spark task of one barrier
stage; ``hvd.init()`` joins the job exactly as under horovodrun. With a real cluster,
pass ``--master spark://host:7077`` (every executor needs torch and horovod_torch).
"""
import argparse
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(epochs, lr, batch_size):
    """Runs on every rank: synthetic regression data, sharded by rank."""
    import torch
    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(1234)
    x = torch.randn(1024, 16)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(1024, 1)
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]  # this rank's shard

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters())
    for epoch in range(epochs):
        for i in range(0, len(x), batch_size):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[i:i + batch_size]),
                                                y[i:i + batch_size])
            loss.backward()
            optimizer.step()
        avg = hvd.allreduce(loss.detach(), name="loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {avg:.4f}", flush=True)
    return hvd.rank(), avg


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    # Run from a checkout whose extension is built in place (`make build`): this script
    # and the executors it starts import horovod_torch from it. An unbuilt checkout
    # would hide an installed horovod_torch, so it is left off the path.
    if glob.glob(os.path.join(ROOT, "horovod_torch", "_C*.so")):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        sys.path.insert(0, ROOT)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors' Python
    from pyspark.sql import SparkSession
    import horovod.spark

    spark = (SparkSession.builder.master(args.master).appName("horovod_torch spark run")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    try:
        results = horovod.spark.run(train, args=(args.epochs, args.lr, args.batch_size),
                                    num_proc=args.num_proc)
        print("results by rank:", results)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
