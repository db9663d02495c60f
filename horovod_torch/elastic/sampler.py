"""ElasticSampler: shards a dataset over the current world and, after a reset,
re-shards only the samples not yet processed in this epoch."""
import math
from typing import Iterable, Iterator, List

import torch

from horovod_torch import basics


class ElasticSampler(torch.utils.data.Sampler):
    """Like DistributedSampler, but re-reads rank and size on reset() and skips the
    indices recorded as processed (``record_batch`` / ``record_indices``)."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set = set()
        self.indices: List[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts a new epoch: new shuffle order, nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks this rank's batch `batch_idx` (of `batch_size`) as processed."""
        self.record_indices(self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size])

    def record_indices(self, indices: Iterable[int]) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-shards the remaining indices over the current world."""
        self.num_replicas = basics.size() if basics.is_initialized() else 1
        self.rank = basics.rank() if basics.is_initialized() else 0
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        remaining = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        total = self.num_samples * self.num_replicas
        if remaining and total > len(remaining):  # pad so every rank has as many
            repeats = math.ceil(total / len(remaining))
            remaining = (remaining * repeats)[:total]
        self.indices = remaining[self.rank:total:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
