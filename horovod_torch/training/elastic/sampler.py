"""ElasticSampler: shards a dataset over the current world and, after a reset,
re-shards only the samples not yet processed in this epoch.

Horovod's API, with Horovod's names: ``processed_num``, ``processed_indices``,
``remaining_indices``, ``record_batch``, ``record_indices``, ``get_indices``,
``state_dict`` / ``load_state_dict`` (which also read Horovod's
``{"epoch", "processed_num"}`` dicts).

What is processed is kept as a set of dataset indices, so a sync merges every rank's
progress exactly (the union), even when ranks recorded different numbers of batches.
``processed_num`` is the size of that set: the samples this rank recorded, and after
``state.sync()`` those of every rank. (Horovod counts ``batch_size * size()`` per
``record_batch`` call on every rank instead; in a world of one the two agree.)
"""
import math
from typing import Iterable, Iterator, List

import torch

from horovod_torch.engine import basics
from horovod_torch.engine.basics import rank, size  # noqa: F401  (Horovod's module has them)


class ElasticSampler(torch.utils.data.Sampler):
    """Like DistributedSampler, but re-reads rank and size on reset() and leaves out the
    indices recorded as processed (``record_batch`` / ``record_indices``).

    Use it as Horovod documents: put it in the ``TorchState``, call
    ``record_batch(batch_idx, batch_size)`` after each batch of
    ``for batch_idx, batch in enumerate(loader)``, and ``set_epoch`` at the end of the
    epoch (it clears what was processed).

    Batch numbers are those of the pass over the sampler in progress: a pass starts
    when the DataLoader iterates the sampler (or at ``set_epoch``). A reset in the
    middle of a pass (``state.restore()`` / ``state.sync()``) that leaves this rank's
    remaining samples in the same order keeps the numbering, so a loop that goes on
    enumerating the same pass still records the batches it trained on; a reset that
    re-shards differently starts a new pass (``sampler.indices`` is then the new shard).

    Args:
        dataset: the dataset to sample (its length must not change).
        shuffle: shuffle the indices (default True), in the same order on every rank.
        seed: shuffling seed, identical on every rank (default 0).
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set = set()
        self._unshared: List[int] = []  # recorded, not yet shared by a commit
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []  # this epoch's unprocessed, in order
        self.num_samples = 0
        self.total_size = 0
        self.indices: List[int] = []  # this rank's shard of the remaining indices
        self._shard: List[int] = []
        self._pass: List[int] = []    # the pass in progress, from its start: it
        self._pass_offset = 0         # goes on with indices == _pass[_pass_offset:]
        self._reshard(new_pass=True)

    # ------------------------------------------------------------------ progress

    @property
    def processed_num(self) -> int:
        """How many of this epoch's samples are recorded as processed."""
        return len(self.processed_indices)

    @processed_num.setter
    def processed_num(self, n: int) -> None:
        # Horovod's meaning: the first n samples of the epoch's order are done.
        self.processed_indices = set(self._epoch_order()[:int(n)])

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch `epoch`: its shuffle order, nothing processed. Call it at the
        end of an epoch (not the start), so a reset within an epoch keeps the progress."""
        self.epoch = epoch
        self.processed_indices = set()
        self._unshared = []
        self._reshard(new_pass=True)

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """The indices of batch `batch_idx` (of `batch_size`) of the pass in progress on
        this rank; the last batch may be short."""
        start = batch_idx * batch_size
        return self._pass[start:start + batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records this rank's batch `batch_idx` (of `batch_size`) as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Records dataset indices as processed."""
        new = [int(i) for i in indices]
        self.processed_indices.update(new)
        self._unshared += new

    def take_unshared(self) -> List[int]:
        """The indices recorded since the last call (or since the state was loaded or the
        epoch set): what TorchState's commit tells the other ranks."""
        new, self._unshared = self._unshared, []
        return new

    # --------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state_dict of ours, or Horovod's ``{"epoch", "processed_num"}``
        (the first processed_num samples of the epoch's order), and re-shards."""
        new_epoch = state_dict["epoch"] != self.epoch
        self.epoch = state_dict["epoch"]
        self._unshared = []
        if state_dict.get("processed_indices") is not None:
            self.processed_indices = set(int(i) for i in state_dict["processed_indices"])
        else:
            self.processed_num = state_dict.get("processed_num", 0)
        self._reshard(new_pass=new_epoch)

    # ------------------------------------------------------------------ sharding

    def _epoch_order(self) -> List[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        # DistributedSampler's order for the same seed and epoch.
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def reset(self) -> None:
        """Re-shards the remaining indices over the current world."""
        self._reshard(new_pass=False)

    def _reshard(self, new_pass: bool) -> None:
        self.num_replicas = basics.size() if basics.is_initialized() else 1
        self.rank = basics.rank() if basics.is_initialized() else 0
        remaining = [i for i in self._epoch_order() if i not in self.processed_indices]
        self.remaining_indices = remaining
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        self.total_size = self.num_samples * self.num_replicas
        padded = remaining
        if remaining and self.total_size > len(remaining):  # every rank gets as many
            repeats = math.ceil(self.total_size / len(remaining))
            padded = (remaining * repeats)[:self.total_size]
        self._shard = padded[self.rank:self.total_size:self.num_replicas]

        # Does the pass in progress go on? Yes if the new shard is what is left of it
        # once the samples now recorded as processed are taken off its front.
        done = len(self._pass) - len(self._shard)
        if (not new_pass and done >= 0 and self._pass[done:] == self._shard
                and all(i in self.processed_indices for i in self._pass[:done])):
            self._pass_offset = done
        else:
            self._new_pass()
        self.indices = list(self._shard)

    def _new_pass(self) -> None:
        self._pass = list(self._shard)
        self._pass_offset = 0

    def __iter__(self) -> Iterator[int]:
        # A new pass over the shard of the last reset (recording alone does not
        # re-shard: a loader iterated again without a reset repeats the same samples).
        self._new_pass()
        self.indices = list(self._shard)
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
