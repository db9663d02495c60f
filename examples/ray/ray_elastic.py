"""Elastic training on Ray with horovod_torch (``horovod.ray.ElasticRayExecutor``):
the Ray cluster's nodes are the hosts; when a worker actor (or its node) dies, the
surviving workers go on in their own processes from the last commit, and workers
on new nodes join at the next commit.

    python examples/ray/ray_elastic.py                # local Ray, 3 CPUs: 3 workers
    python examples/ray/ray_elastic.py --kill-at 20   # ray.kill one worker at step 20
    python examples/ray/ray_elastic.py --address auto --min-workers 2 --max-workers 8

With ``--kill-at`` the driver kills the newest worker actor when rank 0 passes that
step; the output shows the job re-forming with the survivors and the step they
resume from. (On one machine, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray and
the job on 127.0.0.1.)
"""
import argparse
import os
import tempfile
import threading
import time

import ray
import torch
import torch.nn as nn

from horovod.ray import ElasticRayExecutor


def train_fn(steps, lr, report_dir):
    import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=gen)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1)
    model = nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    # step: the next step to run; committed with the model and the optimizer
    state = hvd.elastic.TorchState(model, opt, step=0)
    me = ray.get_runtime_context().get_actor_name()

    def on_reset():
        print(f"[{me}] job re-formed: rank {hvd.rank()} of {hvd.size()}, resuming at step "
              f"{state.step}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            shard = slice(hvd.rank(), None, hvd.size())  # re-sharded at every size
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[shard]), y[shard])
            loss.backward()
            opt.step()
            state.step += 1
            time.sleep(0.05)  # a slower step, so a kill lands mid-training
            state.commit()
            if hvd.rank() == 0:
                with open(os.path.join(report_dir, "progress"), "w") as f:
                    f.write(f"{state.step} {hvd.size()}")
                if state.step % 10 == 0:
                    print(f"step {state.step}: loss {loss.item():.4f} on {hvd.size()} "
                          "workers", flush=True)

    train(state)
    return hvd.rank(), hvd.size(), state.step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-workers", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--kill-at", type=int, default=None,
                        help="ray.kill the newest worker when rank 0 passes this step")
    parser.add_argument("--address", default=None,
                        help="a Ray cluster to join (default: start a local one)")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.max_workers, include_dashboard=False)
    report_dir = tempfile.mkdtemp(prefix="ray_elastic_")  # rank 0's progress, for --kill-at

    settings = ElasticRayExecutor.create_settings(
        min_num_proc=args.min_workers, max_num_proc=args.max_workers, elastic_timeout=120)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)
    executor.start()

    if args.kill_at is not None:
        threading.Thread(target=kill_one_at, args=(args.kill_at, report_dir),
                         daemon=True).start()
    results = executor.run(train_fn, kwargs=dict(steps=args.steps, lr=args.lr,
                                                 report_dir=report_dir))
    for rank, size, step in results:
        print(f"worker rank {rank}/{size} finished at step {step}")
    ray.shutdown()


def kill_one_at(step, report_dir):
    """Kills the newest worker actor once rank 0 has passed `step`."""
    path = os.path.join(report_dir, "progress")
    while True:
        try:
            with open(path) as f:
                done, size = (int(v) for v in f.read().split())
        except (OSError, ValueError):
            done, size = 0, 0
        if done >= step and size > 1:
            break
        time.sleep(0.05)
    names = [n for n in ray.util.list_named_actors() if n.startswith("horovod_torch-")]
    victim = max(names, key=lambda n: int(n.rsplit("-", 1)[1]))  # the executor's naming
    print(f"--- killing worker actor {victim} at step {done} ---", flush=True)
    ray.kill(ray.get_actor(victim))


if __name__ == "__main__":
    main()
