"""Allreduce of sparse COO tensors: ``hvd.sparse_allreduce_async``.

As in Horovod, a sparse tensor is reduced by allgathering every rank's indices and
values (two allgathers; ranks may have different nnz) and building one sparse tensor
from all of them; duplicate indices are summed when it is coalesced.

Horovod returns a closure here; this build returns a :class:`SparseHandle` (a
:class:`horovod_torch.handle.Handle`). Both collectives are submitted when
``sparse_allreduce_async`` is called; ``hvd.synchronize(handle)``, the handle's
``synchronize()``, or calling the handle (as Horovod's closure is called) waits for
them and returns the result, and ``hvd.poll(handle)`` tells whether that would block.
"""
from typing import Optional

import torch

from horovod_torch.engine.basics import Average, Sum
from horovod_torch.common.handle import Handle
from horovod_torch.collectives.ops import allgather_async
from horovod_torch.collectives.process_sets import _ps_id, _set_size, global_process_set
from horovod_torch.collectives.submit import _auto_name
from horovod_torch.collectives.submit import poll as _poll
from horovod_torch.collectives.submit import synchronize as _synchronize


class SparseHandle(Handle):
    """The pending result of :func:`sparse_allreduce_async`.

    ``synchronize()`` waits for the two allgathers and returns the reduced, coalesced
    sparse tensor; later calls return the same tensor. ``poll()`` tells whether it
    would block.
    """

    def __init__(self, tensor: torch.Tensor, op: int, world: int, indices_handle: int,
                 values_handle: int):
        self._size = tensor.size()
        self._dtype = tensor.dtype
        self._device = tensor.device
        self._op = op
        self._world = world
        self._indices_handle = indices_handle
        self._values_handle = values_handle
        self._result: Optional[torch.Tensor] = None

    def poll(self) -> bool:
        if self._result is not None:
            return True
        return _poll(self._values_handle) and _poll(self._indices_handle)

    def synchronize(self) -> torch.Tensor:
        if self._result is None:
            values = _synchronize(self._values_handle)
            indices = _synchronize(self._indices_handle)  # (total nnz, sparse_dim)
            out = torch.sparse_coo_tensor(indices.t(), values, self._size,
                                          dtype=self._dtype, device=self._device).coalesce()
            if self._op == Average:
                v = out.values()
                if v.dtype.is_floating_point or v.dtype.is_complex:
                    v = v / self._world
                else:  # integers truncate, as the dense allreduce does
                    v = torch.div(v, self._world, rounding_mode="trunc")
                out = torch.sparse_coo_tensor(out.indices(), v, self._size,
                                              dtype=self._dtype, device=self._device,
                                              is_coalesced=True)
            self._result = out
        return self._result

    __call__ = synchronize  # Horovod's handle is a closure: handle() gives the result


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                           process_set=global_process_set) -> SparseHandle:
    """Starts reducing the sparse COO `tensor` over all ranks.

    op=Sum gives the sum of every rank's tensor; op=Average divides the summed values
    by the number of ranks. Every rank must pass a tensor of the same size, dtype and
    sparse/dense dimensions; nnz may differ (and may be 0). Uncoalesced inputs are
    accepted. Returns a :class:`SparseHandle`: call ``handle.synchronize()`` or
    ``horovod_torch.sparse.synchronize(handle)`` for the coalesced sparse result.
    The collectives are named ``<name>.indices`` and ``<name>.values``.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise ValueError("sparse_allreduce_async expects a torch sparse COO tensor, got "
                         f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    if op not in (Sum, Average):
        raise ValueError(f"sparse_allreduce_async supports op=Sum or op=Average, got op={op}")
    psid = _ps_id(process_set)
    name = _auto_name("sparse_allreduce", name, psid)
    # Allgather concatenates along dim 0, so indices go as (nnz, sparse_dim).
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    indices_handle = allgather_async(indices, name=f"{name}.indices", process_set=process_set)
    values_handle = allgather_async(values, name=f"{name}.values", process_set=process_set)
    return SparseHandle(tensor, op, _set_size(psid), indices_handle, values_handle)


def synchronize(handle):
    """``hvd.synchronize``: a SparseHandle gives its sparse result."""
    return _synchronize(handle)
