"""Collectives with Horovod's signatures: sync, async (handle), in-place (``_``),
grouped, and autograd-aware versions. Every op is keyed by its name; unnamed ops get
a generated name and are matched across ranks by submission order."""
import itertools
import threading
import warnings
from typing import Dict, List, Optional, Sequence

import torch

from horovod_torch import _C, basics
from horovod_torch import adasum as _adasum
from horovod_torch.basics import (Adasum, Average, Max, Min, Product, Sum, raise_for_status,
                                  rank, size)
from horovod_torch.compression import Compression
from horovod_torch.handle import Handle

_name_lock = threading.Lock()
_counters: Dict[tuple, "itertools.count"] = {}


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


def _thread_tag() -> str:
    """"" for the main thread and threads Python did not start (autograd's, for one:
    which of them runs a backward differs between ranks); else the thread's name,
    ".<name>". Threads a script starts are named in the order it starts them
    ("Thread-3 (work)"), the same on every rank."""
    t = threading.current_thread()
    if t is threading.main_thread() or isinstance(t, threading._DummyThread):  # noqa: SLF001
        return ""
    return "." + t.name


def _auto_name(kind: str, name: Optional[str], psid: int = 0) -> str:
    """The name of an op submitted without one: kind and a count, as Horovod names it.
    Ranks outside a set do not count its ops (one counter per set), and a thread the
    script started counts its own ops under its own name: two threads submitting
    unnamed ops at once would otherwise pair rank 0's op of one thread with rank 1's
    of the other, a silently wrong result. A thread started in a different order on
    some rank gets other names there: its ops then wait, and the stall report names
    them."""
    if name is not None:
        return name
    tag = _thread_tag()
    with _name_lock:
        counter = _counters.setdefault((kind, psid, tag), itertools.count())
        n = next(counter)
    base = kind if psid == 0 else f"{kind}.ps{psid}"
    return f"{base}.noname{tag}.{n}"


def reset_auto_names() -> None:
    with _name_lock:
        _counters.clear()


_OPS = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
        Product: "Product"}


def _resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        if op is not None:
            raise ValueError("op and average cannot both be given")
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, bool) or op not in _OPS:
        raise ValueError(f"op={op!r} is not a reduction op; use one of "
                         + ", ".join(f"hvd.{n}" for n in _OPS.values()))
    return op


def _submit(kind: int, inputs: List[torch.Tensor], outputs: List[Optional[torch.Tensor]],
            names: List[str], op: int = Sum, root: int = 0, prescale: float = 1.0,
            postscale: float = 1.0, splits: Optional[List[int]] = None,
            grouped: bool = False, psid: int = 0) -> List[int]:
    code, message, handles = _C.submit(kind, inputs, outputs, names, int(op), int(root),
                                       float(prescale), float(postscale),
                                       list(splits or []), grouped, psid)
    raise_for_status(code, message)
    return handles  # the core keeps the tensors alive until the op completes


def _contig(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError("collectives take dense tensors; for a sparse tensor use "
                         "hvd.sparse_allreduce_async(tensor, name=..., op=...) "
                         "(DistributedOptimizer does this for sparse gradients)")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def poll(handle) -> bool:
    """True if the op behind `handle` has finished (synchronize() will not block)."""
    if isinstance(handle, Handle):
        return handle.poll()
    done = _C.poll(handle)
    if done is None:
        raise ValueError(f"unknown handle {handle}: it was already synchronized or never existed")
    return done


def _wait(handle: int):
    result = _C.wait(handle)
    if result is None:
        raise ValueError(f"unknown handle {handle}: it was already synchronized or never existed")
    code, message, output, splits = result
    raise_for_status(code, message)
    return output, splits


def _wait_many(handles: list) -> List[torch.Tensor]:
    """The outputs of many async ops (not alltoall), as one wait: the core releases
    the GIL once and makes the caller's stream wait once per fused batch."""
    if any(isinstance(h, Handle) for h in handles):
        return [synchronize(h) for h in handles]
    outs = []
    for h, result in zip(handles, _C.wait_many(list(handles))):
        if result is None:
            raise ValueError(f"unknown handle {h}: it was already synchronized or never existed")
        code, message, output, _ = result
        raise_for_status(code, message)
        outs.append(output)
    return outs


def synchronize(handle):
    """Waits for an async op; returns its output (alltoall: (output, received_splits))."""
    if isinstance(handle, Handle):
        return handle.synchronize()
    output, splits = _wait(handle)
    if splits is not None:
        return output, splits
    return output


# ---------------------------------------------------------------- allreduce

def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, psid=0):
    if op == Adasum:
        if psid != 0:
            raise ValueError("op=hvd.Adasum runs on the global process set only")
        return _adasum.submit(tensor, output, _auto_name("allreduce", name), prescale_factor,
                              postscale_factor)
    code, message, handle = _C.submit_one(_C.OP_ALLREDUCE, tensor, output,
                                          _auto_name("allreduce", name, psid), int(op), 0,
                                          float(prescale_factor), float(postscale_factor), psid)
    raise_for_status(code, message)
    return handle


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Starts an out-of-place allreduce; returns a handle for poll()/synchronize()."""
    psid = _ps_id(process_set)
    op = _resolve_op(op, average)
    tensor = _contig(tensor)
    return _allreduce_async(tensor, torch.empty_like(tensor), name, op, prescale_factor,
                            postscale_factor, psid)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Starts an in-place allreduce of `tensor`; returns a handle."""
    psid = _ps_id(process_set)
    op = _resolve_op(op, average)
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, psid)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """In-place allreduce; returns `tensor`."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce (same op) of the output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, prescale_factor, postscale_factor, process_set
        return synchronize(allreduce_async(tensor, name=name, op=op,
                                           prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor,
                                           process_set=process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output, op=ctx.op, prescale_factor=ctx.pre,
                                           postscale_factor=ctx.post, process_set=ctx.ps))
        return grad, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set) -> torch.Tensor:
    """Reduces `tensor` over all ranks (default: average); the input is unchanged."""
    _ps_id(process_set)
    op = _resolve_op(op, average)
    compressed, cctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(compressed, name, op, prescale_factor, postscale_factor,
                                 process_set)
    return compression.decompress(out, cctx)


def _group_names(kind: str, name: Optional[str], n: int, psid: int = 0) -> List[str]:
    base = _auto_name(kind, name, psid)
    return [f"{base}.{i}" for i in range(n)]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> "GroupHandle":
    """Starts an allreduce of every tensor as one atomic group; returns handles."""
    psid = _ps_id(process_set)
    op = _resolve_op(op, average)
    tensors = [_contig(t) for t in tensors]
    outputs = [torch.empty_like(t) for t in tensors]
    return _grouped(_C.OP_ALLREDUCE, "grouped_allreduce", tensors, outputs, name, op,
                    prescale_factor, postscale_factor, psid)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> "GroupHandle":
    psid = _ps_id(process_set)
    op = _resolve_op(op, average)
    return _grouped(_C.OP_ALLREDUCE, "grouped_allreduce", list(tensors), list(tensors), name,
                    op, prescale_factor, postscale_factor, psid)


class GroupHandle(Handle):
    """The one handle of a grouped op (as in Horovod): ``hvd.synchronize(handle)``
    returns the list of outputs and ``hvd.poll(handle)`` is True when all are done.
    It also iterates over the per-tensor handles."""

    def __init__(self, handles):
        self.handles = list(handles)

    def poll(self) -> bool:
        return all(poll(h) for h in self.handles)

    def synchronize(self) -> list:
        # Every member is waited for (and its name freed) before an error is raised.
        return _wait_many(self.handles)

    def __iter__(self):
        return iter(self.handles)

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, i):
        return self.handles[i]


def _grouped(kind, kind_name, tensors, outputs, name, op, pre, post, psid=0):
    return GroupHandle(_grouped_handles(kind, kind_name, tensors, outputs, name, op, pre, post,
                                        psid))


def _grouped_handles(kind, kind_name, tensors, outputs, name, op, pre, post, psid=0):
    if not tensors:
        return []
    if op == Adasum:
        if kind != _C.OP_ALLREDUCE:
            raise ValueError("op=hvd.Adasum is only defined for allreduce")
        if psid != 0:
            raise ValueError("op=hvd.Adasum runs on the global process set only")
        return [_adasum.submit(t, o, n, pre, post) for t, o, n in
                zip(tensors, outputs, _group_names(kind_name, name, len(tensors)))]
    return _submit(kind, tensors, outputs, _group_names(kind_name, name, len(tensors), psid),
                   op, prescale=pre, postscale=post, grouped=True, psid=psid)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce whose gradients are the grouped allreduce (same op and
    factors) of the output gradients."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(
            list(tensors), average, name, op, prescale_factor, postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        op, pre, post, ps = ctx.args
        grads = synchronize(grouped_allreduce_async(
            [g.contiguous() for g in grad_outputs], op=op, prescale_factor=pre,
            postscale_factor=post, process_set=ps))
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> List[torch.Tensor]:
    _ps_id(process_set)
    op = _resolve_op(op, average)
    if not tensors:
        return []
    compressed = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(None, name, op, prescale_factor, postscale_factor,
                                         process_set, *[c[0] for c in compressed])
    return [compression.decompress(o, c[1]) for o, c in zip(outs, compressed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    handles = grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                       postscale_factor, process_set)
    return [synchronize(h) for h in handles]


# ---------------------------------------------------------------- allgather

def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Starts concatenating `tensor` from every rank along dimension 0."""
    psid = _ps_id(process_set)
    return _submit(_C.OP_ALLGATHER, [_contig(tensor)], [None],
                   [_auto_name("allgather", name, psid)], psid=psid)[0]


class HorovodAllgather(torch.autograd.Function):
    """Allgather whose gradient is this rank's slice of the output gradient averaged
    over the ranks (Horovod's convention)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0] if tensor.dim() > 0 else 0
        ctx.ps = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average,
                                           process_set=ctx.ps))
        return _own_rows([grad], [ctx.dim], ctx.ps)[0], None, None


def _own_rows(grads, dims, process_set):
    """This rank's rows of each gathered gradient: rank r's input had dims[i] rows of
    the i-th tensor, and every rank's first dimensions are gathered to find where
    they start."""
    psid = _ps_id(process_set)
    gathered = synchronize(grouped_allgather_async(
        [torch.tensor([d], dtype=torch.int64) for d in dims], process_set=process_set))
    r = _set_rank(psid)
    return [g.narrow(0, int(all_dims[:r].sum()), d)
            for g, all_dims, d in zip(grads, gathered, dims)]


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenates `tensor` from every rank along dimension 0 (sizes may differ)."""
    _ps_id(process_set)
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> "GroupHandle":
    psid = _ps_id(process_set)
    tensors = [_contig(t) for t in tensors]
    if not tensors:
        return GroupHandle([])
    return GroupHandle(_submit(_C.OP_ALLGATHER, tensors, [None] * len(tensors),
                               _group_names("grouped_allgather", name, len(tensors), psid),
                               grouped=True, psid=psid))


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather; each gradient as HorovodAllgather's."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() > 0 else 0 for t in tensors]
        ctx.ps = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = synchronize(grouped_allreduce_async(
            [g.contiguous() for g in grad_outputs], op=Average, process_set=ctx.ps))
        return (None, None, *_own_rows(grads, ctx.dims, ctx.ps))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    _ps_id(process_set)
    if not tensors:
        return []
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# ---------------------------------------------------------------- broadcast

def _set_root(root_rank: int, psid: int) -> int:
    """root_rank is a global rank (as in Horovod); the engine wants its index in the set."""
    if psid == 0:
        return root_rank
    ranks = _registry[psid].ranks
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not in {_registry[psid]!r}; give the "
                         "global rank of one of its members")
    return ranks.index(root_rank)


def _broadcast_async(tensor, output, root_rank, name, psid):
    return _submit(_C.OP_BROADCAST, [tensor], [output], [_auto_name("broadcast", name, psid)],
                   root=_set_root(root_rank, psid), psid=psid)[0]


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    psid = _ps_id(process_set)
    tensor = _contig(tensor)
    return _broadcast_async(tensor, tensor.clone(), root_rank, name, psid)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    psid = _ps_id(process_set)
    return _broadcast_async(tensor, tensor, root_rank, name, psid)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrites `tensor` on every rank with root_rank's value."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast whose gradient (the output gradient averaged over the ranks, as in
    Horovod) flows to the root only."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.ps = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average,
                                           process_set=ctx.ps))
        if rank() != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Returns root_rank's `tensor` on every rank; the input is unchanged."""
    _ps_id(process_set)
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# ---------------------------------------------------------------- alltoall

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Starts an alltoall: rows splits[i] go to rank i (even split if None)."""
    psid = _ps_id(process_set)
    tensor = _contig(tensor)
    n = _set_size(psid)
    if splits is None:
        if tensor.dim() == 0 or tensor.shape[0] % n != 0:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by "
                             f"the number of ranks ({n}); got shape {list(tensor.shape)}")
        split_list = [tensor.shape[0] // n] * n
    else:
        if isinstance(splits, torch.Tensor):
            split_list = [int(x) for x in splits.flatten().tolist()]
        else:
            split_list = [int(x) for x in splits]
        if len(split_list) != n:
            raise ValueError(f"alltoall splits has {len(split_list)} entries but there are "
                             f"{n} ranks; give one count per rank")
        if any(x < 0 for x in split_list):
            raise ValueError("alltoall splits must be non-negative")
        if tensor.dim() == 0 or sum(split_list) != tensor.shape[0]:
            raise ValueError(f"alltoall splits sum to {sum(split_list)} but the tensor's first "
                             f"dimension is {tensor.shape[0] if tensor.dim() else 'missing'}")
    return _submit(_C.OP_ALLTOALL, [tensor], [None], [_auto_name("alltoall", name, psid)],
                   splits=split_list, psid=psid)[0]


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall whose gradient is the reverse alltoall of the output gradient."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.ps = received, process_set
        if splits is None:
            return output
        if isinstance(splits, torch.Tensor) and received.device != splits.device:
            received = received.to(splits.device)  # where the caller keeps its splits (Horovod)
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received,
                                             process_set=ctx.ps))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatters slices of `tensor` to every rank and gathers what they send.

    Returns the output, or (output, received_splits) when `splits` is given.
    """
    _ps_id(process_set)
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# ---------------------------------------------------------------- reducescatter

_REDUCESCATTER_OPS = (Average, Sum, Min, Max, Product)


def _check_reducescatter_op(op) -> None:
    if op not in _REDUCESCATTER_OPS:
        # RuntimeError, as Horovod raises for an op the reduction does not support.
        raise RuntimeError("reducescatter supports op=hvd.Average, Sum, Min, Max or Product "
                           f"(got {_OPS.get(op, op)}; Adasum is not defined for reducescatter)")


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0, splits=None) -> int:
    """Starts a reduce-scatter: rank r gets rows [r*k, ...) of the reduction, where the
    first (dim0 % size) ranks get one extra row. With ``splits`` (one row count per
    rank, summing to dim 0, the same on every rank) rank r gets the splits[r] rows
    after the first r ranks' instead."""
    psid = _ps_id(process_set)
    _check_reducescatter_op(op)
    return _submit(_C.OP_REDUCESCATTER, [_contig(tensor)], [None],
                   [_auto_name("reducescatter", name, psid)], op, prescale=prescale_factor,
                   postscale=postscale_factor, splits=_split_list(splits), psid=psid)[0]


def _split_list(splits) -> Optional[List[int]]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    return [int(x) for x in splits]


def _reducescatter_grads(grads, op, process_set, prescale_factor, postscale_factor):
    """The gradients of a reduce-scatter's inputs, Horovod's convention: the output
    gradients gathered, times the set's size for Sum (Average: as they are), times
    both scale factors."""
    scale = prescale_factor * postscale_factor
    if op == Sum:
        scale *= _set_size(_ps_id(process_set))
    grads = [g.contiguous() if scale == 1.0 else g * scale for g in grads]
    return synchronize(grouped_allgather_async(grads, process_set=process_set))


class HorovodReducescatter(torch.autograd.Function):
    """Reduce-scatter whose gradient is the allgather of the output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor, splits):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor, splits))

    @staticmethod
    def backward(ctx, grad_output):
        return (_reducescatter_grads([grad_output], *ctx.args)[0],
                None, None, None, None, None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0, splits=None) -> torch.Tensor:
    """The reduction of ``tensor`` over the process set, cut along dim 0: this rank's
    rows (see reducescatter_async, and its ``splits``)."""
    _ps_id(process_set)
    _check_reducescatter_op(op)
    compressed, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                     postscale_factor, _split_list(splits))
    return compression.decompress(out, cctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    psid = _ps_id(process_set)
    _check_reducescatter_op(op)
    tensors = [_contig(t) for t in tensors]
    return _grouped(_C.OP_REDUCESCATTER, "grouped_reducescatter", tensors,
                    [None] * len(tensors), name, op, prescale_factor, postscale_factor, psid)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reduce-scatter; each gradient as HorovodReducescatter's."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None, None, None, None,
                *_reducescatter_grads(list(grad_outputs), *ctx.args))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    _ps_id(process_set)
    _check_reducescatter_op(op)
    if not tensors:
        return []
    compressed = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                             postscale_factor, *[c[0] for c in compressed])
    return [compression.decompress(o, c[1]) for o, c in zip(outs, compressed)]


# ---------------------------------------------------------------- barrier

def barrier(process_set=global_process_set) -> None:
    """Blocks until every rank of `process_set` has called barrier()."""
    psid = _ps_id(process_set)
    synchronize(_submit(_C.OP_BARRIER, [], [], [_auto_name("barrier", None, psid)],
                        psid=psid)[0])


def join(device: int = -1) -> int:
    """Tells the other ranks this one has no more data. Until every rank has joined,
    this rank takes part in the others' allreduces with zeros (other collectives
    fail while ranks have joined); the zeros of CUDA allreduces go on CUDA device
    `device` (default: that of this rank's last CUDA op). Returns the rank that
    joined last."""
    if isinstance(device, torch.device):
        device = -1 if device.index is None else device.index
    if isinstance(device, bool) or not isinstance(device, int) or device < -1:
        raise ValueError(f"join(device=...) takes a CUDA device index or -1; got {device!r}")
    out = synchronize(_submit(_C.OP_JOIN, [], [], ["join"], root=device)[0])
    return int(out[0])


# ---------------------------------------------------------------- process sets

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
    handle = _submit(_C.OP_ADD_PROCESS_SET, [], [], [_auto_name("add_process_set", None)],
                     splits=process_set.ranks)[0]
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
    handle = _submit(_C.OP_REMOVE_PROCESS_SET, [], [],
                     [_auto_name("remove_process_set", None)], root=psid)[0]
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
