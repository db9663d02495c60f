"""Elastic training with sharded optimizer state, run under horovodrun by
test_sharded.py. Every rank trains on the same full batch, so the averaged gradient,
and so the whole trajectory, is the one a single process has whatever the world
size: at the end each rank compares the parameters and the consolidated optimizer
state with a single-process run of the same steps.

Environment: STEPS, KILL_RANKS (comma-separated ranks that die together at
KILL_STEP, once: marker file MARKER; KILL_AT=commit: after that step's optimizer
step, before its commit, instead of before the step), STAGE (1, 2, or rs: 2 with
reduce_scatter_gradients), EDIT_STEP/EDIT_FILE/EDIT_TEXT
(rank 0 rewrites the discovery file at that step to remove or add hosts),
WAIT_STEP/WAIT_SIZE (see tests.workers.edit_hosts_and_wait), DEVICE (cuda: each
rank trains on the GPU of its local rank)."""
import os
import time

import torch
import torch.nn as nn

import horovod.torch as hvd
from tests.workers import edit_hosts_and_wait, report_recovery_once

STEPS = int(os.environ.get("STEPS", "40"))
KILL_STEP = int(os.environ.get("KILL_STEP", "-1"))
KILL_RANKS = {int(r) for r in os.environ.get("KILL_RANKS", "").split(",") if r}
KILL_AT = os.environ.get("KILL_AT", "step")


DEVICE = os.environ.get("DEVICE", "cpu")


def build(device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1)).to(device)
    groups = [{"params": list(model[0].parameters()), "lr": 0.02},
              {"params": [p for m in model[1:] for p in m.parameters()]}]
    return model, torch.optim.AdamW(groups, lr=0.01, weight_decay=0.05)


gen = torch.Generator().manual_seed(1)
data = torch.randn(64, 8, generator=gen)
target = data.sum(1, keepdim=True).sin()


def loss_of(model):
    device = next(model.parameters()).device
    return ((model(data.to(device)) - target.to(device)) ** 2).mean()


hvd.init()
if DEVICE == "cuda":
    torch.cuda.set_device(hvd.local_rank())
    DEVICE = f"cuda:{hvd.local_rank()}"
model, base = build(DEVICE)
STAGE = os.environ.get("STAGE", "1")
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                               shard_optimizer_state=2 if STAGE == "rs" else int(STAGE),
                               reduce_scatter_gradients=STAGE == "rs")
state = hvd.elastic.TorchState(model, opt, step=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
reported = []


def die_once(step):
    """The ranks of KILL_RANKS exit at KILL_STEP, once in the job."""
    if (step == KILL_STEP and hvd.rank() in KILL_RANKS
            and not os.path.exists(os.environ["MARKER"])):
        time.sleep(0.2)  # the others have reached this step's collectives
        with open(os.environ["MARKER"] + f".{hvd.rank()}", "w") as f:
            f.write(str(time.time()))
        if hvd.rank() == max(KILL_RANKS):
            os.rename(os.environ["MARKER"] + f".{hvd.rank()}", os.environ["MARKER"])
        os._exit(3)


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        if KILL_AT == "step":
            die_once(state.step)
        edit_hosts_and_wait(state)
        opt.zero_grad()
        loss_of(state.model).backward()
        opt.step()
        state.step += 1
        report_recovery_once(resets, reported)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.02")))
        if KILL_AT == "commit":
            die_once(state.step - 1)
        state.commit()


train(state)
ref_model, ref_opt = build()
for _ in range(STEPS):
    ref_opt.zero_grad()
    loss_of(ref_model).backward()
    ref_opt.step()
params_ok = all(torch.allclose(p.cpu(), q, rtol=1e-4, atol=1e-6)
                for p, q in zip(model.parameters(), ref_model.parameters()))
opt.consolidate_state_dict(root_rank=None)
full, ref = opt.state_dict(), ref_opt.state_dict()
state_ok = sorted(full["state"]) == sorted(ref["state"]) and all(
    torch.allclose(torch.as_tensor(v).float(), torch.as_tensor(full["state"][k][key]).float(),
                   rtol=1e-4, atol=1e-7)
    for k, st in ref["state"].items() for key, v in st.items())
print(f"FINAL rank={hvd.rank()} size={hvd.size()} step={state.step} params_ok={params_ok} "
      f"state_ok={state_ok} owned={len(opt.state)} resets={','.join(map(str, resets)) or 'none'}", flush=True)
