"""A small elastic training script used by test_elastic.py (run under horovodrun).

Environment knobs: STEPS, KILL_RANK/KILL_STEP (that rank dies once at that step,
marker file MARKER), EDIT_STEP/EDIT_FILE/EDIT_TEXT (rank 0 rewrites the discovery
file at that step, to add or remove hosts), WAIT_STEP/WAIT_SIZE (see
tests.workers.edit_hosts_and_wait), LATE_INIT_S (a worker started after the
kill waits that long before hvd.init(), as a slow start would)."""
import os
import time

import torch
import torch.nn as nn

import horovod.torch as hvd
from tests.workers import edit_hosts_and_wait, report_recovery_once

if os.environ.get("LATE_INIT_S") and os.path.exists(os.environ.get("MARKER", "")):
    time.sleep(float(os.environ["LATE_INIT_S"]))
    print(f"LATE_READY at={time.time():.3f}", flush=True)
hvd.init()
torch.manual_seed(0)
STEPS = int(os.environ.get("STEPS", "40"))
dev = torch.device("cpu")
if os.environ.get("DEVICE") == "cuda":
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
model = nn.Linear(8, 1).to(dev)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters())
data = torch.randn(256, 8).to(dev)
target = data.sum(1, keepdim=True)
sampler = hvd.elastic.ElasticSampler(list(range(256)), shuffle=True, seed=1)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, step=0, epoch=0, batch=0)
resets = []
reported = []
state.register_reset_callbacks([
    lambda: resets.append(hvd.size()),
    lambda: print(f"RESET size={hvd.size()} at={time.time():.3f}", flush=True)])


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        idx = state.sampler.indices[state.batch * 8:(state.batch + 1) * 8]
        if len(idx) < 8:
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            continue
        if (hvd.rank() == int(os.environ.get("KILL_RANK", "-1"))
                and state.step == int(os.environ.get("KILL_STEP", "-1"))
                and (os.environ.get("KILL_ALWAYS") or not os.path.exists(os.environ["MARKER"]))):
            with open(os.environ["MARKER"], "w") as f:
                f.write(str(time.time()))
            os._exit(3)
        edit_hosts_and_wait(state)
        opt.zero_grad()
        loss = ((state.model(data[idx]) - target[idx]) ** 2).mean()
        loss.backward()
        opt.step()
        state.sampler.record_batch(state.batch, 8)
        state.batch += 1
        state.step += 1
        report_recovery_once(resets, reported)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.02")))
        state.commit()


train(state)
w = torch.cat([p.detach().flatten() for p in model.parameters()])
all_w = hvd.allgather(w.unsqueeze(0), name="final_weights")
same = all(torch.allclose(all_w[0], all_w[q]) for q in range(hvd.size()))
print(f"FINAL rank={hvd.rank()} size={hvd.size()} step={state.step} same={same} "
      f"resets={resets}", flush=True)
