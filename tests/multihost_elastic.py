"""Elastic worker for test_multihost.py: trains until rank 0 sees $STOP_FILE.

Every 5 steps rank 0 prints ``STEP n size=S hosts=h1,h2`` (the hosts of the current
workers, in rank order), so the test can follow the job as hosts fail and join;
at the end every rank prints ``FINAL rank=.. size=.. host=.. same=..``.
"""
import os
import sys
import time

import torch
import torch.nn as nn

import horovod.torch as hvd

hvd.init()
torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
data = torch.randn(64, 8)
target = data.sum(1, keepdim=True)
state = hvd.elastic.TorchState(model, opt, step=0)
HOST = os.environ["HOROVOD_HOSTNAME"]


def say(text):
    sys.stdout.write(text + "\n")  # one write per line
    sys.stdout.flush()


@hvd.elastic.run
def train(state):
    while state.step < 100000:
        opt.zero_grad()
        loss = ((model(data) - target) ** 2).mean()
        loss.backward()
        opt.step()
        state.step += 1
        stop = hvd.rank() == 0 and os.path.exists(os.environ["STOP_FILE"])
        if hvd.allreduce(torch.tensor([float(stop)]), op=hvd.Sum, name="stop").item() > 0:
            return
        if state.step % 5 == 0:
            names = hvd.allgather_object(HOST)
            if hvd.rank() == 0:
                say(f"STEP {state.step} size={hvd.size()} hosts={','.join(names)}")
        time.sleep(0.05)
        state.commit()


train(state)
w = torch.cat([p.detach().flatten() for p in model.parameters()])
all_w = hvd.allgather(w.unsqueeze(0), name="final_weights")
same = all(torch.allclose(all_w[0], all_w[q]) for q in range(hvd.size()))
say(f"FINAL rank={hvd.rank()} size={hvd.size()} host={HOST} same={same}")
