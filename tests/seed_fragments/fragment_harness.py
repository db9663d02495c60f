"""Scaffolding for the seed fragments: what a fragment assumes its script already has
(parsed arguments, a model, a few batches) and the checks that run after it. Nothing
here is a user's line; each fragment file keeps those between its BEGIN/END markers.

Every fragment file runs on its own under the launcher, e.g.
``horovodrun -np 2 python tests/seed_fragments/seed003_4_distributed_optimizer.py``,
and ends by printing ``FRAGMENT OK <id>`` on every rank (tests/test_seed_fragments.py).
"""
import argparse
from typing import Iterable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The flags of the guides' training scripts (examples/elastic/train.py)."""
    p = argparse.ArgumentParser(description="seed fragment harness")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--no-cuda", action="store_true", default=False)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--fp16-allreduce", action="store_true", default=False)
    p.add_argument("--use-adasum", action="store_true", default=False)
    p.add_argument("--out-dir", default=None, help="where fragments may write files")
    p.add_argument("--expect-cuda", action="store_true",
                   help="fail unless the fragment ran on a GPU")
    args = p.parse_args(argv)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


class Net(nn.Module):
    """The guides' MNIST network (examples/elastic/train.py), log_softmax over dim 1."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        return F.log_softmax(self.fc2(x), dim=1)


def model_for_this_rank(device: str = "cpu") -> Net:
    """A model initialised differently on every rank (as before a broadcast)."""
    torch.manual_seed(1000 + hvd.rank())
    return Net().to(device)


def batches(steps: int, batch_size: int = 16, device: str = "cpu"):
    """MNIST-shaped random batches, different on every rank."""
    g = torch.Generator().manual_seed(7 + hvd.rank())
    for _ in range(steps):
        data = torch.randn(batch_size, 1, 28, 28, generator=g)
        target = torch.randint(0, 10, (batch_size,), generator=g)
        yield data.to(device), target.to(device)


def train(model: nn.Module, optimizer, steps: int = 3, device: str = "cpu") -> None:
    model.train()
    for data, target in batches(steps, device=device):
        optimizer.zero_grad()
        F.nll_loss(model(data), target).backward()
        optimizer.step()


def same_on_every_rank(tensors: Iterable[torch.Tensor], name: str) -> bool:
    flat = torch.cat([t.detach().float().cpu().flatten() for t in tensors]).unsqueeze(0)
    gathered = hvd.allgather(flat, name=f"harness.{name}")
    return all(torch.equal(gathered[0], row) for row in gathered)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"rank {hvd.rank()}: {message}")


def done(fragment_id: str) -> None:
    """Every rank got here: print the line the test looks for, then shut down."""
    hvd.barrier()
    print(f"FRAGMENT OK {fragment_id} rank {hvd.rank()} of {hvd.size()}", flush=True)
    hvd.shutdown()
