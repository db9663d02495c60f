"""Adasum (adaptive summation) on any device, built from allgather.

adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b: parallel gradients
are averaged, orthogonal ones added. Ranks are combined pairwise in a binary tree
((0,1), (2,3), then the pairs of results, ...), computed in float64 on every rank
from the same gathered inputs, so every rank gets bitwise the same result. This costs
size() times the data of an allreduce; it makes Adasum available without MPI.
"""
import torch

from horovod_torch import _C
from horovod_torch.collectives.submit import _submit, synchronize
from horovod_torch.common.handle import DoneHandle
from horovod_torch.engine.basics import size


def check_size() -> None:
    n = size()
    if n & (n - 1):
        raise ValueError(f"op=hvd.Adasum needs a power-of-two number of ranks; this job has "
                         f"{n}. Use hvd.Average, or run with 1, 2, 4, 8, ... ranks")


def _combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dot = torch.dot(a, b)
    na, nb = torch.dot(a, a), torch.dot(b, b)
    ca = 1 - dot / (2 * na) if na > 0 else torch.ones((), dtype=a.dtype, device=a.device)
    cb = 1 - dot / (2 * nb) if nb > 0 else torch.ones((), dtype=a.dtype, device=a.device)
    return ca * a + cb * b


def reduce_gathered(gathered: torch.Tensor) -> torch.Tensor:
    """Adasum of the rows of `gathered` (one row per rank), in float64."""
    vals = [row.double() for row in gathered]
    while len(vals) > 1:
        vals = [_combine(vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]
    return vals[0]


def adasum(tensor: torch.Tensor, name: str, prescale: float, postscale: float) -> torch.Tensor:
    check_size()
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"op=hvd.Adasum needs a floating-point tensor, got {tensor.dtype}")
    flat = tensor.detach().reshape(1, -1) * prescale
    # The allgather goes by the op's own name, so a rank that asked for another op of
    # that name meets it as a mismatch (allreduce vs allgather) instead of a wait.
    try:
        gathered = synchronize(_submit(_C.OP_ALLGATHER, [flat.contiguous()], [None], [name])[0])
    except RuntimeError as e:
        raise RuntimeError(f"{e} (this rank asked for op=hvd.Adasum, which runs as an "
                           "allgather)") from None
    return (reduce_gathered(gathered) * postscale).to(tensor.dtype).view_as(tensor)


def submit(tensor: torch.Tensor, output: torch.Tensor, name: str, prescale: float,
           postscale: float) -> DoneHandle:
    """Runs Adasum now and returns a handle for synchronize()."""
    output.copy_(adasum(tensor, name, prescale, postscale))
    return DoneHandle(output)
