"""Process sets: ``hvd.ProcessSet``, the registry of this process's sets (id 0:
``global_process_set``), and registering and removing sets on every rank."""
from typing import Dict, List, Optional, Sequence

from horovod_torch import _C
from horovod_torch.engine import basics
from horovod_torch.engine.basics import rank, size
from horovod_torch.collectives.submit import _auto_name, _submit_control, synchronize

class ProcessSet:
    """A set of ranks that run collectives together.

    Create it from a list of ranks, then register it on every rank with
    ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set()`` (which sets its
    ``process_set_id``), and pass it as ``process_set=`` to collectives. ``root_rank``
    stays a global rank; alltoall ``splits`` and allgather results follow the set's
    rank order (``ps.rank()``). ``hvd.global_process_set`` holds every rank and has id 0.
    """

    def __init__(self, ranks_or_comm: Sequence[int]):
        if hasattr(ranks_or_comm, "Get_rank") and hasattr(ranks_or_comm, "Get_size"):
            raise ValueError("process sets from an MPI communicator need an MPI build of "
                             "horovod_torch; give a list of ranks instead")
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet needs a list of ranks, got "
                             f"{type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, got {ranks}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
        self.ranks: Optional[List[int]] = sorted(ranks)
        self.process_set_id: Optional[int] = None

    def _members(self) -> Optional[List[int]]:
        if self.process_set_id == 0:
            return list(range(size()))
        return self.ranks

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None while it is not registered."""
        if self.process_set_id is None:
            return None
        return len(self._members())

    def rank(self) -> Optional[int]:
        """This process's rank within the set, -1 if it is not a member; None while the
        set is not registered."""
        if self.process_set_id is None:
            return None
        members = self._members()
        return members.index(rank()) if rank() in members else -1

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set; None while it is not registered."""
        if self.process_set_id is None:
            return None
        return rank() in self._members()

    def invalidate(self) -> None:
        self.process_set_id = None

    def __eq__(self, other) -> bool:
        return (isinstance(other, ProcessSet) and other.process_set_id == self.process_set_id
                and (self.process_set_id == 0 or other.ranks == self.ranks))

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks or ())))

    def __repr__(self) -> str:
        if self.process_set_id == 0:
            return "ProcessSet(process_set_id=0, global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.ranks = None
global_process_set.process_set_id = 0

# Registered sets of this process, by id (0: global_process_set).
_registry: Dict[int, ProcessSet] = {0: global_process_set}


def _ps_id(process_set) -> int:
    """The engine id of `process_set` (None means the global set)."""
    if process_set is None:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered: pass it to "
                         "hvd.init(process_sets=[...]) or hvd.add_process_set() on every rank "
                         "first (or it was removed)")
    psid = process_set.process_set_id
    if psid != 0 and rank() not in process_set.ranks:
        raise ValueError(f"rank {rank()} is not in {process_set!r}; only its members may call "
                         "collectives on it")
    return psid


def _set_size(psid: int) -> int:
    return size() if psid == 0 else len(_registry[psid].ranks)


def _set_rank(psid: int) -> int:
    return rank() if psid == 0 else _registry[psid].rank()


def _set_root(root_rank: int, psid: int) -> int:
    """root_rank is a global rank (as in Horovod); the engine wants its index in the set."""
    if psid == 0:
        return root_rank
    ranks = _registry[psid].ranks
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not in {_registry[psid]!r}; give the "
                         "global rank of one of its members")
    return ranks.index(root_rank)


def _register(process_set, static: bool) -> ProcessSet:
    """Registers a set on every rank (a collective on the global set)."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id == 0:
        return process_set
    if process_set.process_set_id is not None and process_set.process_set_id in _registry:
        raise ValueError(f"{process_set!r} is already registered")
    bad = [r for r in process_set.ranks if r < 0 or r >= size()]
    if bad or not process_set.ranks:
        raise ValueError(f"process set ranks {process_set.ranks} must be non-empty and in "
                         f"[0, {size()})")
    if static:  # init(process_sets=[...]): equal sets share one id; all ranks: the global set
        if process_set.ranks == list(range(size())):
            process_set.process_set_id = 0
            return process_set
        for ps in _registry.values():
            if ps.process_set_id != 0 and ps.ranks == process_set.ranks:
                process_set.process_set_id = ps.process_set_id
                return process_set
    handle = _submit_control(_C.CONTROL_ADD_PROCESS_SET, _auto_name("add_process_set", None),
                             ranks=process_set.ranks)
    process_set.process_set_id = int(synchronize(handle)[0])
    _registry[process_set.process_set_id] = process_set
    return process_set


def add_process_set(process_set) -> ProcessSet:
    """Registers a process set (a ProcessSet or a list of ranks) after init; every rank
    must call it, in the same order. Needs HOROVOD_DYNAMIC_PROCESS_SETS=1. Returns the
    registered ProcessSet."""
    if not basics.dynamic_process_sets():
        raise ValueError("add_process_set() needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 for every worker, or pass the sets to "
                         "hvd.init(process_sets=[...])")
    return _register(process_set, static=False)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a registered process set on every rank (all must call it); its ops still
    pending fail. Returns False for the global set or a set that is not registered.
    Needs HOROVOD_DYNAMIC_PROCESS_SETS=1."""
    if not basics.dynamic_process_sets():
        raise ValueError("remove_process_set() needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 for every worker")
    psid = process_set.process_set_id if isinstance(process_set, ProcessSet) else None
    if not psid or psid not in _registry:
        return False
    handle = _submit_control(_C.CONTROL_REMOVE_PROCESS_SET,
                             _auto_name("remove_process_set", None), remove_id=psid)
    synchronize(handle)
    for ps in [p for p in _registry.values() if p.process_set_id == psid]:
        ps.invalidate()
    del _registry[psid]
    return True


def _reset_process_sets() -> None:
    """After init(): only the global set is registered."""
    global_process_set.ranks = list(range(size()))
    for psid, ps in list(_registry.items()):
        if psid != 0:
            ps.invalidate()
            del _registry[psid]
