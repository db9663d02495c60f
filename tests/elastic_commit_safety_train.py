"""An elastic training script for tests/test_elastic_commit_safety.py (run under
horovodrun). It commits after every step and then prints
``STEP rank=R size=S step=N t=<time.time()>``, so every printed step is a commit.

Environment:
  OUT_DIR      each worker writes ``<worker id with / as _>.pid`` (its pid) as it
               starts, ``....init`` right after hvd.init() and ``....synced`` when its
               first state.sync() has completed (the training function starts)
  SLOW_FROM    workers whose id number (``host/<n>``) is at least this ...
  SYNC_DELAY   ... sleep this many seconds between hvd.init() and their first
               state.sync() (makes the window the test kills into deterministic)
  STOP_FILE    training stops (on every rank at the same step) once this file exists
  STEPS        or at this step; STEP_SLEEP: seconds per step
"""
import os

WID = os.environ["HOROVOD_ELASTIC_WORKER_ID"]
BASE = os.path.join(os.environ["OUT_DIR"], WID.replace("/", "_"))
with open(BASE + ".pid", "w") as f:  # before the slow imports
    f.write(str(os.getpid()))

import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import horovod.torch as hvd  # noqa: E402

hvd.init()
with open(BASE + ".init", "w") as f:
    f.write(f"{time.time()} rank={hvd.rank()} size={hvd.size()}")

STEPS = int(os.environ.get("STEPS", "1000000"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
STOP_FILE = os.environ.get("STOP_FILE", "")
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
x = torch.randn(16, 4)
y = x.sum(1, keepdim=True)
state = hvd.elastic.TorchState(model, opt, step=0)

if int(WID.rsplit("/", 1)[1]) >= int(os.environ.get("SLOW_FROM", "1000000")):
    time.sleep(float(os.environ.get("SYNC_DELAY", "0")))


@hvd.elastic.run
def train(state):
    if not os.path.exists(BASE + ".synced"):
        with open(BASE + ".synced", "w") as f:
            f.write(f"{time.time()} step={state.step}")
    while True:
        stop = float(state.step >= STEPS or bool(STOP_FILE and os.path.exists(STOP_FILE)))
        if hvd.allreduce(torch.tensor([stop]), op=hvd.Max, name="stop").item():
            return
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        state.step += 1
        time.sleep(STEP_SLEEP)
        state.commit()
        print(f"STEP rank={hvd.rank()} size={hvd.size()} step={state.step} "
              f"t={time.time():.6f}", flush=True)


train(state)
print(f"FINAL rank={hvd.rank()} size={hvd.size()} step={state.step}", flush=True)
