"""Collectives with Horovod's signatures: sync, async (handle), in-place (``_``),
grouped, and autograd-aware versions. Every op is keyed by its name; unnamed ops get
a generated name and are matched across ranks by submission order."""
from typing import List, Optional

import torch

from horovod_torch import _C
from horovod_torch.collectives import adasum as _adasum
from horovod_torch.engine.basics import (Adasum, Average, Max, Min, Product, Sum,
                                         raise_for_status, rank)
from horovod_torch.collectives.compression import Compression
from horovod_torch.collectives.process_sets import (ProcessSet, _ps_id, _set_rank,  # noqa: F401
                                                    _set_root, _set_size, add_process_set,
                                                    global_process_set, remove_process_set)
from horovod_torch.collectives.submit import (_OPS, GroupHandle, _auto_name, _contig,  # noqa: F401
                                              _group_names, _resolve_op, _submit, _submit_control,
                                              _wait_many, poll, reset_auto_names, synchronize)

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
    synchronize(_submit_control(_C.CONTROL_BARRIER, _auto_name("barrier", None, psid), psid=psid))


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
    out = synchronize(_submit_control(_C.CONTROL_JOIN, "join", join_device=device))
    return int(out[0])


