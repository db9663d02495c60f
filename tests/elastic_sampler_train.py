"""An elastic training script that reads its data through ElasticSampler as Horovod's
documentation does (a DataLoader over the sampler, record_batch after each batch, a
commit per batch), printing every sample it trains on: `SEEN epoch=E idx=i,j,...`.
Used by test_stragglers.py (run under horovodrun). Environment: EPOCHS, N (dataset
size), SLOW_HOST/SLOW_S (the workers on that host sleep that long per batch)."""
import os
import time

import torch

import horovod.torch as hvd

hvd.init()
N, B, EPOCHS = int(os.environ.get("N", "240")), 4, int(os.environ.get("EPOCHS", "2"))
SLOW = float(os.environ.get("SLOW_S", "0")) \
    if os.environ.get("HOROVOD_HOSTNAME") == os.environ.get("SLOW_HOST") else 0.0
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
data = torch.randn(N, 4)
sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(list(range(N)), batch_size=B, sampler=sampler)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0)


@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
        for batch_idx, idx in enumerate(loader):
            time.sleep(0.02 + SLOW)
            opt.zero_grad()
            model(data[idx]).square().mean().backward()
            opt.step()
            state.sampler.record_batch(batch_idx, B)
            print(f"SEEN epoch={state.epoch} idx={','.join(str(int(i)) for i in idx)}",
                  flush=True)
            state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(state)
print(f"FINAL rank={hvd.rank()} size={hvd.size()} step={state.epoch} same=True", flush=True)
