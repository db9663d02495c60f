"""Collectives with Horovod's signatures: sync, async (handle), in-place (``_``),
grouped, and autograd-aware versions. Every op is keyed by its name; unnamed ops get
a generated name and are matched across ranks by submission order."""
import itertools
import threading
import warnings
from typing import Dict, List, Optional, Sequence

import torch

from horovod_torch import _C
from horovod_torch import adasum as _adasum
from horovod_torch.basics import (Adasum, Average, Max, Min, Product, Sum, raise_for_status,
                                  rank, size)
from horovod_torch.compression import Compression

_name_lock = threading.Lock()
_counters: Dict[str, "itertools.count"] = {}


class ProcessSet:
    """A set of ranks collectives can be restricted to. Only the global set exists
    in this build; passing it (or None) is accepted everywhere."""

    def __init__(self, ranks: Optional[Sequence[int]] = None):
        self.ranks = list(ranks) if ranks is not None else None
        self.process_set_id = 0

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and other.process_set_id == self.process_set_id

    def __hash__(self) -> int:
        return hash(self.process_set_id)

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set != global_process_set:
        raise ValueError("process sets other than hvd.global_process_set are not supported by "
                         "this build yet")


def _auto_name(kind: str, name: Optional[str]) -> str:
    if name is not None:
        return name
    with _name_lock:
        counter = _counters.setdefault(kind, itertools.count())
        return f"{kind}.noname.{next(counter)}"


def reset_auto_names() -> None:
    with _name_lock:
        _counters.clear()


def _resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        if op is not None:
            raise ValueError("op and average cannot both be given")
        return Average if average else Sum
    return Average if op is None else op


def _submit(kind: int, inputs: List[torch.Tensor], outputs: List[Optional[torch.Tensor]],
            names: List[str], op: int = Sum, root: int = 0, prescale: float = 1.0,
            postscale: float = 1.0, splits: Optional[List[int]] = None,
            grouped: bool = False) -> List[int]:
    code, message, handles = _C.submit(kind, inputs, outputs, names, int(op), int(root),
                                       float(prescale), float(postscale),
                                       list(splits or []), grouped)
    raise_for_status(code, message)
    return handles  # the core keeps the tensors alive until the op completes


def _contig(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def poll(handle: int) -> bool:
    """True if the op behind `handle` has finished (synchronize() will not block)."""
    if hasattr(handle, "synchronize"):  # sparse_allreduce_async's handle
        return handle.poll() if hasattr(handle, "poll") else True
    if handle in _adasum._results:
        return True
    done = _C.poll(handle)
    if done is None:
        raise ValueError(f"unknown handle {handle}: it was already synchronized or never existed")
    return done


def _wait(handle: int):
    if handle in _adasum._results:
        return _adasum._results.pop(handle), None
    result = _C.wait(handle)
    if result is None:
        raise ValueError(f"unknown handle {handle}: it was already synchronized or never existed")
    code, message, output, splits = result
    raise_for_status(code, message)
    return output, splits


def synchronize(handle: int):
    """Waits for an async op; returns its output (alltoall: (output, received_splits))."""
    if hasattr(handle, "synchronize"):  # sparse_allreduce_async's handle
        return handle.synchronize()
    output, splits = _wait(handle)
    if splits is not None:
        return output, splits
    return output


# ---------------------------------------------------------------- allreduce

def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor):
    if op == Adasum:
        return _adasum.submit(tensor, output, _auto_name("allreduce", name), prescale_factor,
                              postscale_factor)
    code, message, handle = _C.submit_one(_C.OP_ALLREDUCE, tensor, output,
                                          _auto_name("allreduce", name), int(op), 0,
                                          float(prescale_factor), float(postscale_factor))
    raise_for_status(code, message)
    return handle


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Starts an out-of-place allreduce; returns a handle for poll()/synchronize()."""
    _check_process_set(process_set)
    op = _resolve_op(op, average)
    tensor = _contig(tensor)
    return _allreduce_async(tensor, torch.empty_like(tensor), name, op, prescale_factor,
                            postscale_factor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Starts an in-place allreduce of `tensor`; returns a handle."""
    _check_process_set(process_set)
    op = _resolve_op(op, average)
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """In-place allreduce; returns `tensor`."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce (same op) of the output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.op, ctx.pre, ctx.post = op, prescale_factor, postscale_factor
        return synchronize(allreduce_async(tensor, name=name, op=op,
                                           prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output, op=ctx.op, prescale_factor=ctx.pre,
                                           postscale_factor=ctx.post))
        return grad, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set) -> torch.Tensor:
    """Reduces `tensor` over all ranks (default: average); the input is unchanged."""
    _check_process_set(process_set)
    op = _resolve_op(op, average)
    compressed, cctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


def _group_names(kind: str, name: Optional[str], n: int) -> List[str]:
    base = _auto_name(kind, name)
    return [f"{base}.{i}" for i in range(n)]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> List[int]:
    """Starts an allreduce of every tensor as one atomic group; returns handles."""
    _check_process_set(process_set)
    op = _resolve_op(op, average)
    tensors = [_contig(t) for t in tensors]
    outputs = [torch.empty_like(t) for t in tensors]
    return _grouped(_C.OP_ALLREDUCE, "grouped_allreduce", tensors, outputs, name, op,
                    prescale_factor, postscale_factor)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> List[int]:
    _check_process_set(process_set)
    op = _resolve_op(op, average)
    return _grouped(_C.OP_ALLREDUCE, "grouped_allreduce", list(tensors), list(tensors), name,
                    op, prescale_factor, postscale_factor)


def _grouped(kind, kind_name, tensors, outputs, name, op, pre, post):
    if not tensors:
        return []
    if op == Adasum:
        if kind != _C.OP_ALLREDUCE:
            raise ValueError("op=hvd.Adasum is only defined for allreduce")
        return [_adasum.submit(t, o, n, pre, post) for t, o, n in
                zip(tensors, outputs, _group_names(kind_name, name, len(tensors)))]
    return _submit(kind, tensors, outputs, _group_names(kind_name, name, len(tensors)), op,
                   prescale=pre, postscale=post, grouped=True)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> List[torch.Tensor]:
    compressed = [compression.compress(t) for t in tensors]
    handles = grouped_allreduce_async([c[0] for c in compressed], average, name, op,
                                      prescale_factor, postscale_factor, process_set)
    return [compression.decompress(synchronize(h), c[1]) for h, c in zip(handles, compressed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    handles = grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                       postscale_factor, process_set)
    return [synchronize(h) for h in handles]


# ---------------------------------------------------------------- allgather

def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Starts concatenating `tensor` from every rank along dimension 0."""
    _check_process_set(process_set)
    return _submit(_C.OP_ALLGATHER, [_contig(tensor)], [None],
                   [_auto_name("allgather", name)])[0]


class HorovodAllgather(torch.autograd.Function):
    """Allgather whose gradient is this rank's slice of the summed output gradient."""

    @staticmethod
    def forward(ctx, tensor, name):
        ctx.dim = tensor.shape[0] if tensor.dim() > 0 else 0
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output, op=Sum))
        dims = synchronize(allgather_async(torch.tensor([ctx.dim], dtype=torch.int64)))
        offset = int(dims[:rank()].sum())
        return grad.narrow(0, offset, ctx.dim), None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenates `tensor` from every rank along dimension 0 (sizes may differ)."""
    _check_process_set(process_set)
    return HorovodAllgather.apply(tensor, name)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> List[int]:
    _check_process_set(process_set)
    tensors = [_contig(t) for t in tensors]
    if not tensors:
        return []
    return _submit(_C.OP_ALLGATHER, tensors, [None] * len(tensors),
                   _group_names("grouped_allgather", name, len(tensors)), grouped=True)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return [synchronize(h) for h in grouped_allgather_async(tensors, name, process_set)]


# ---------------------------------------------------------------- broadcast

def _broadcast_async(tensor, output, root_rank, name):
    return _submit(_C.OP_BROADCAST, [tensor], [output], [_auto_name("broadcast", name)],
                   root=root_rank)[0]


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    _check_process_set(process_set)
    tensor = _contig(tensor)
    return _broadcast_async(tensor, tensor.clone(), root_rank, name)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    _check_process_set(process_set)
    return _broadcast_async(tensor, tensor, root_rank, name)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrites `tensor` on every rank with root_rank's value."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast whose gradient (summed over ranks) flows to the root only."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output, op=Sum))
        if rank() != ctx.root_rank:
            grad = grad * 0
        return grad, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Returns root_rank's `tensor` on every rank; the input is unchanged."""
    _check_process_set(process_set)
    return HorovodBroadcast.apply(tensor, root_rank, name)


# ---------------------------------------------------------------- alltoall

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Starts an alltoall: rows splits[i] go to rank i (even split if None)."""
    _check_process_set(process_set)
    tensor = _contig(tensor)
    n = size()
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
    return _submit(_C.OP_ALLTOALL, [tensor], [None], [_auto_name("alltoall", name)],
                   splits=split_list)[0]


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall whose gradient is the reverse alltoall of the output gradient."""

    @staticmethod
    def forward(ctx, tensor, splits, name):
        output, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received))
        return grad, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatters slices of `tensor` to every rank and gathers what they send.

    Returns the output, or (output, received_splits) when `splits` is given.
    """
    _check_process_set(process_set)
    return HorovodAlltoall.apply(tensor, splits, name)


# ---------------------------------------------------------------- reducescatter

def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0,
                        postscale_factor=1.0, process_set=global_process_set) -> int:
    """Starts a reduce-scatter: rank r gets rows [r*k, ...) of the reduction, where the
    first (dim0 % size) ranks get one extra row."""
    _check_process_set(process_set)
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError("reducescatter supports op=Average, Sum, Min, Max or Product "
                         "(Adasum is not defined for reducescatter)")
    return _submit(_C.OP_REDUCESCATTER, [_contig(tensor)], [None],
                   [_auto_name("reducescatter", name)], op, prescale=prescale_factor,
                   postscale=postscale_factor)[0]


class HorovodReducescatter(torch.autograd.Function):
    """Reduce-scatter whose gradient is the allgather of the output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.op = op
        ctx.scale = prescale_factor * postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allgather_async(grad_output.contiguous()))
        if ctx.op == Average:
            grad = grad / size()
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        return grad, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  prescale_factor=1.0, postscale_factor=1.0,
                  process_set=global_process_set) -> torch.Tensor:
    _check_process_set(process_set)
    compressed, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, prescale_factor=1.0,
                                postscale_factor=1.0, process_set=global_process_set):
    _check_process_set(process_set)
    tensors = [_contig(t) for t in tensors]
    return _grouped(_C.OP_REDUCESCATTER, "grouped_reducescatter", tensors,
                    [None] * len(tensors), name, op, prescale_factor, postscale_factor)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          prescale_factor=1.0, postscale_factor=1.0,
                          process_set=global_process_set):
    compressed = [compression.compress(t) for t in tensors]
    handles = grouped_reducescatter_async([c[0] for c in compressed], name, op,
                                          prescale_factor, postscale_factor, process_set)
    return [compression.decompress(synchronize(h), c[1]) for h, c in zip(handles, compressed)]


# ---------------------------------------------------------------- barrier

def barrier(process_set=global_process_set) -> None:
    """Blocks until every rank has called barrier()."""
    _check_process_set(process_set)
    synchronize(_submit(_C.OP_BARRIER, [], [], [_auto_name("barrier", None)])[0])


def join(device: int = -1) -> int:
    """Tells the other ranks this one has no more data. Until every rank has joined,
    this rank takes part in the others' allreduces with zeros (other collectives
    fail while ranks have joined). Returns the rank that joined last."""
    out = synchronize(_submit(_C.OP_JOIN, [], [], ["join"])[0])
    return int(out[0])
