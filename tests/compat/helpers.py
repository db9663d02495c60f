"""Inputs and references shared by the compatibility tests: every rank builds every
rank's input (a deterministic function of rank and seed), so each rank can check a
collective's result on its own."""
from typing import List

import torch

from tests.workers import reference_reduce

import horovod.torch as hvd

# Every dtype the engine moves (uint16/32/64, complex and float8 are refused).
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]
REDUCE_OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max,
              "Product": hvd.Product}


def make(rank: int, shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, shape, generator=g).to(dtype)


def everyone(shape, dtype: torch.dtype, seed: int = 0) -> List[torch.Tensor]:
    """The inputs of ranks 0 .. size-1."""
    return [make(q, shape, dtype, seed) for q in range(hvd.size())]


def reduce_ref(inputs: List[torch.Tensor], op: int) -> torch.Tensor:
    """What an allreduce of `inputs` with `op` gives, computed in one process
    (integer Average truncates toward zero, as Horovod's integer scaling does)."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(inputs)
        return stacked.any(0) if op in (hvd.Sum, hvd.Max) else stacked.all(0)
    return reference_reduce(inputs, op, dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype.is_floating_point:
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-6)
        ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(got, want)
    assert ok, f"{what}: got {got.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}"


def same_on_every_rank(t: torch.Tensor, name: str) -> bool:
    """True if `t` is bitwise equal on every rank."""
    gathered = hvd.allgather(t.detach().reshape(1, -1).contiguous(), name=name)
    return all(torch.equal(gathered[0], row) for row in gathered)


def sync_group(handles) -> List[torch.Tensor]:
    """The outputs of a grouped_*_async call. horovod_torch returns one handle per tensor;
    Horovod returns one handle for the group, whose synchronize() gives every output
    (see test_grouped_async_returns_one_handle_for_the_group). Either way, this works."""
    if isinstance(handles, (list, tuple)):
        return [hvd.synchronize(h) for h in handles]
    return list(hvd.synchronize(handles))
