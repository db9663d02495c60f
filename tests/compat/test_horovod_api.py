"""Horovod's torch API, as a Horovod user's test suite exercises it: names, probes,
topology, init/shutdown, every collective in every flavour (sync, in-place, async,
grouped) with every reduction op and dtype, edge cases (empty and 0-d tensors, zero
rows, zero splits) and the errors users get for bad input or disagreeing ranks.

Run on every rank: ``horovodrun -np 2 python -m pytest tests/compat -q -p
no:cacheprovider`` (tests/test_compat.py does). Each test calls ``hvd.init()`` (the
`initialized` fixture, or itself) and ends with ``hvd.barrier(); hvd.shutdown()``.
Where horovod_torch differs from Horovod on purpose (a clearer error, a friendlier
answer), the test asserts what horovod_torch does and says so; known
incompatibilities are ``xfail(strict=True)`` with the reason.
"""
import importlib
import os
import time

import pytest
import torch

import horovod.torch as hvd
from tests.compat.helpers import (DTYPES, REDUCE_OPS, assert_close, everyone, make,
                                  reduce_ref, sync_group)

# Every public name of horovod.torch in Horovod 0.28 (horovod/torch/__init__.py), plus
# is_homogeneous from its basics.
HOROVOD_TORCH_NAMES = """
elastic Compression allgather_object broadcast_object broadcast_optimizer_state
broadcast_parameters allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce
grouped_allreduce_async grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async
allgather allgather_async grouped_allgather grouped_allgather_async broadcast broadcast_async
broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async
grouped_reducescatter grouped_reducescatter_async join barrier poll synchronize init shutdown
is_initialized start_timeline stop_timeline size local_size cross_size rank local_rank
cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built
ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set add_process_set
remove_process_set Average Sum Adasum Min Max Product HorovodInternalError
DistributedOptimizer SyncBatchNorm is_homogeneous
""".split()

TOPOLOGY = ["rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"]
BUILT_PROBES = ["mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
                "cuda_built", "rocm_built"]


def _n() -> int:
    return hvd.size()


# ------------------------------------------------------------------ names and probes

def test_every_horovod_torch_name_is_there():
    missing = [n for n in HOROVOD_TORCH_NAMES if not hasattr(hvd, n)]
    assert not missing, missing
    # Reduction ops are distinct integers with Horovod's values.
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    for sub in ("compression", "functions", "optimizer", "sync_batch_norm", "elastic"):
        importlib.import_module(f"horovod.torch.{sub}")
    from horovod.torch.elastic import ElasticSampler, ObjectState, State, TorchState, run
    assert (run, State, ObjectState, TorchState, ElasticSampler) == (
        hvd.elastic.run, hvd.elastic.State, hvd.elastic.ObjectState, hvd.elastic.TorchState,
        hvd.elastic.ElasticSampler)


def test_mpi_ops_module_can_be_imported():
    mpi_ops = importlib.import_module("horovod.torch.mpi_ops")
    assert mpi_ops.allreduce_async_ is hvd.allreduce_async_ and mpi_ops.Sum == hvd.Sum


def test_horovod_common_exceptions_can_be_imported():
    exceptions = importlib.import_module("horovod.common.exceptions")
    assert exceptions.HorovodInternalError is hvd.HorovodInternalError
    assert exceptions.HostsUpdatedInterrupt is hvd.HostsUpdatedInterrupt


def _built_probes():
    return {p: getattr(hvd, p)() for p in BUILT_PROBES}


def test_probes_before_and_after_init(teardown):
    before = _built_probes()
    assert before["gloo_built"] is True  # the TCP transport stands in for Gloo
    assert before["ddl_built"] is False and before["ccl_built"] is False
    assert before["rocm_built"] is False
    assert isinstance(before["mpi_built"], bool) and isinstance(before["cuda_built"], bool)
    # nccl_built() is the NCCL version code (0 without NCCL), as in Horovod.
    assert isinstance(before["nccl_built"], int) and before["nccl_built"] >= 0
    assert hvd.is_initialized() is False
    assert hvd.gloo_enabled() is False and hvd.mpi_enabled() is False
    # Horovod raises ValueError here too (MPI not enabled / not initialised).
    with pytest.raises(ValueError):
        hvd.mpi_threads_supported()

    hvd.init()
    assert hvd.is_initialized() is True
    assert _built_probes() == before  # what was built does not change with init
    assert hvd.gloo_enabled() is True and hvd.mpi_enabled() is False  # horovodrun: TCP
    # Horovod raises ValueError when MPI is not enabled, and so do we.
    with pytest.raises(ValueError, match="MPI is not enabled"):
        hvd.mpi_threads_supported()

    hvd.barrier()
    hvd.shutdown()
    assert hvd.is_initialized() is False and hvd.gloo_enabled() is False
    assert _built_probes() == before


def test_topology_before_init_raises_value_error():
    assert not hvd.is_initialized()
    for fn in TOPOLOGY + ["is_homogeneous"]:
        with pytest.raises(ValueError, match="not been initialized"):
            getattr(hvd, fn)()
    for call in (lambda: hvd.allreduce(torch.ones(1)), hvd.barrier, hvd.join,
                 lambda: hvd.broadcast_object(1), lambda: hvd.start_timeline("x.json")):
        with pytest.raises(ValueError, match="init"):
            call()


def test_topology(initialized):
    r, n = hvd.rank(), hvd.size()
    assert (r, n) == (int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"]))
    assert hvd.local_rank() == int(os.environ["HOROVOD_LOCAL_RANK"])
    assert hvd.local_size() == int(os.environ["HOROVOD_LOCAL_SIZE"]) == n  # one host
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous() is True
    ranks = hvd.allgather(torch.tensor([r, hvd.local_rank()]).view(1, 2), name="topo")
    assert ranks[:, 0].tolist() == list(range(n)) and ranks[:, 1].tolist() == list(range(n))
    hvd.init()  # a second init() while initialised is a no-op
    assert (hvd.rank(), hvd.size()) == (r, n)


def test_reinit_after_shutdown_many_times(teardown):
    r0 = None
    for i in range(20):
        hvd.init()
        assert hvd.is_initialized()
        r0 = hvd.rank() if r0 is None else r0
        assert hvd.rank() == r0 and hvd.size() == int(os.environ["HOROVOD_SIZE"])
        out = hvd.allreduce(torch.ones(2) * i, name="reinit", op=hvd.Sum)
        assert out.tolist() == [float(i * hvd.size())] * 2
        hvd.barrier()
        hvd.shutdown()
        assert not hvd.is_initialized()
        with pytest.raises(ValueError):
            hvd.rank()
    hvd.shutdown()  # shutting down twice is harmless


# ------------------------------------------------------------------ allreduce

ALLREDUCE_FLAVOURS = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_"]


def _allreduce(flavour: str, t: torch.Tensor, **kw) -> torch.Tensor:
    if flavour == "allreduce":
        out = hvd.allreduce(t, **kw)
    elif flavour == "allreduce_":
        out = hvd.allreduce_(t, **kw)
        assert out is t
    elif flavour == "allreduce_async":
        h = hvd.allreduce_async(t, **kw)
        out = hvd.synchronize(h)
    else:
        h = hvd.allreduce_async_(t, **kw)
        out = hvd.synchronize(h)
        assert out.data_ptr() == t.data_ptr()
    return out


@pytest.mark.parametrize("op_name", list(REDUCE_OPS))
@pytest.mark.parametrize("flavour", ALLREDUCE_FLAVOURS)
def test_allreduce_every_op_and_flavour(initialized, flavour, op_name):
    op = REDUCE_OPS[op_name]
    inputs = everyone((3, 4), torch.float32, seed=len(op_name))
    mine = inputs[hvd.rank()].clone()
    out = _allreduce(flavour, mine, name=f"{flavour}.{op_name}", op=op)
    assert_close(out, reduce_ref(inputs, op), f"{flavour} {op_name}")
    if not flavour.endswith("_"):  # out-of-place: the input is left alone
        assert torch.equal(mine, inputs[hvd.rank()])
    # Unnamed ops are matched by submission order.
    assert_close(_allreduce(flavour, inputs[hvd.rank()].clone(), op=op),
                 reduce_ref(inputs, op), f"unnamed {flavour} {op_name}")


def test_allreduce_default_op_is_average(initialized):
    inputs = everyone((5,), torch.float64, seed=3)
    assert_close(hvd.allreduce(inputs[hvd.rank()]), reduce_ref(inputs, hvd.Average))


@pytest.mark.parametrize("flavour", ALLREDUCE_FLAVOURS)
def test_prescale_and_postscale(initialized, flavour):
    n = _n()
    out = _allreduce(flavour, torch.full((4,), float(hvd.rank() + 1)), op=hvd.Sum,
                     prescale_factor=0.5, postscale_factor=3.0, name=f"scale.{flavour}")
    assert out.tolist() == [1.5 * n * (n + 1) / 2] * 4
    # Average divides after the post-scale.
    out = _allreduce(flavour, torch.full((2,), 2.0), op=hvd.Average, prescale_factor=2.0,
                     postscale_factor=0.25, name=f"scale.avg.{flavour}")
    assert out.tolist() == [1.0, 1.0]
    # Integers are scaled in double and truncated toward zero, per rank before the sum.
    out = _allreduce(flavour, torch.tensor([3, -3, 5]), op=hvd.Sum, prescale_factor=0.5,
                     name=f"scale.int.{flavour}")
    assert out.tolist() == [1 * n, -1 * n, 2 * n]


@pytest.mark.parametrize("op_name", list(REDUCE_OPS))
def test_large_tensors(initialized, op_name):
    """Above HOROVOD_SMALL_ALLREDUCE_BYTES (64 KiB) the engine takes its ring algorithms."""
    r, n = hvd.rank(), _n()
    op = REDUCE_OPS[op_name]
    inputs = [torch.full((50001,), float(q + 1)) for q in range(n)]
    for t in inputs:
        t[-1] = -1.0  # the last element ends the ring's last chunk
    want = reduce_ref(inputs, op)
    assert_close(hvd.allreduce(inputs[r], op=op, name=f"large.{op_name}"), want)
    got = hvd.reducescatter(inputs[r], op=op, name=f"large.rs.{op_name}")
    per = [50001 // n + (1 if q < 50001 % n else 0) for q in range(n)]
    assert_close(got, want[sum(per[:r]):sum(per[:r + 1])])


def test_legacy_average_argument(initialized):
    r, n = hvd.rank(), _n()
    t = torch.full((2,), float(r + 1))
    with pytest.warns(DeprecationWarning, match="average"):
        summed = hvd.allreduce(t, average=False, name="legacy.sum")
    assert summed.tolist() == [n * (n + 1) / 2] * 2
    with pytest.warns(DeprecationWarning):
        avg = hvd.allreduce(t, average=True, name="legacy.avg")
    assert avg.tolist() == [(n + 1) / 2] * 2
    with pytest.warns(DeprecationWarning):
        h = hvd.allreduce_async(t, average=False, name="legacy.async")
    assert hvd.synchronize(h).tolist() == [n * (n + 1) / 2] * 2
    with pytest.warns(DeprecationWarning):
        hvd.allreduce_(t.clone(), average=True, name="legacy.inplace")
    with pytest.warns(DeprecationWarning):
        outs = hvd.grouped_allreduce([t, t * 2], average=False, name="legacy.grouped")
    assert outs[1].tolist() == [n * (n + 1)] * 2
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="op and average"):
        hvd.allreduce(t, average=True, op=hvd.Sum)


@pytest.mark.skipif(os.environ.get("HOROVOD_SIZE") not in ("1", "2", "4", "8"),
                    reason="Adasum needs a power-of-two number of ranks")
def test_adasum(initialized):
    r, n = hvd.rank(), _n()
    # Orthogonal contributions add up; parallel (equal) ones average.
    orth = torch.zeros(n)
    orth[r] = 1.0
    assert hvd.allreduce(orth, op=hvd.Adasum, name="ada.orth").tolist() == [1.0] * n
    same = torch.arange(4.0)
    assert torch.allclose(hvd.allreduce(same, op=hvd.Adasum, name="ada.same"), same)
    inplace = orth.clone()
    hvd.allreduce_(inplace, op=hvd.Adasum, name="ada.inplace")
    assert inplace.tolist() == [1.0] * n
    h = hvd.allreduce_async(orth, op=hvd.Adasum, name="ada.async")
    assert hvd.poll(h) in (True, False)
    assert hvd.synchronize(h).tolist() == [1.0] * n
    h = hvd.allreduce_async_(orth.clone(), op=hvd.Adasum, name="ada.async_")
    assert hvd.synchronize(h).tolist() == [1.0] * n
    outs = hvd.grouped_allreduce([orth, same], op=hvd.Adasum, name="ada.grouped")
    assert outs[0].tolist() == [1.0] * n and torch.allclose(outs[1], same)
    with pytest.raises(ValueError, match="floating-point"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(RuntimeError, match="Adasum"):  # Horovod's exception type
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum)


def test_invalid_op_is_a_local_value_error(teardown):
    hvd.init()
    try:
        with pytest.raises(ValueError):
            hvd.allreduce(torch.ones(2), op=17, name="bad_op")
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after_bad_op")
        assert out.tolist() == [float(_n())] * 2
    finally:
        hvd.shutdown()  # the engine may be gone; no barrier


# ------------------------------------------------------------------ every dtype

def _ops_for(dtype):
    if dtype == torch.bool:  # no Average on bool (and no scaling)
        return [hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
    return list(REDUCE_OPS.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).replace("torch.", "") for d in DTYPES])
def test_every_collective_with_every_dtype(initialized, dtype):
    r, n = hvd.rank(), _n()
    tag = str(dtype)
    inputs = everyone((3, 2), dtype, seed=11)
    for op in _ops_for(dtype):
        assert_close(hvd.allreduce(inputs[r], op=op, name=f"{tag}.ar.{op}"),
                     reduce_ref(inputs, op), f"allreduce {dtype} op={op}")
    outs = hvd.grouped_allreduce([inputs[r], inputs[r][:1]], op=hvd.Max, name=f"{tag}.gar")
    assert_close(outs[0], reduce_ref(inputs, hvd.Max))
    assert_close(outs[1], reduce_ref([t[:1] for t in inputs], hvd.Max))
    # allgather: rank q contributes q + 1 rows
    rows = [make(q, (q + 1, 2), dtype, seed=12) for q in range(n)]
    assert_close(hvd.allgather(rows[r], name=f"{tag}.ag"), torch.cat(rows), f"allgather {dtype}")
    for root in range(n):
        assert_close(hvd.broadcast(inputs[r], root, name=f"{tag}.bc.{root}"), inputs[root])
    # alltoall: rank q sends (q + d) % 2 + 1 rows to rank d
    cnt = [[(q + d) % 2 + 1 for d in range(n)] for q in range(n)]
    sent = [make(q, (sum(cnt[q]), 2), dtype, seed=13) for q in range(n)]
    out, received = hvd.alltoall(sent[r], splits=cnt[r], name=f"{tag}.a2a")
    want = [sent[q][sum(cnt[q][:r]):sum(cnt[q][:r + 1])] for q in range(n)]
    assert_close(out, torch.cat(want), f"alltoall {dtype}")
    assert received.tolist() == [cnt[q][r] for q in range(n)]
    # reducescatter of 2n + 1 rows: the first rank gets one more row
    big = everyone((2 * n + 1, 2), dtype, seed=14)
    per = [(2 * n + 1) // n + (1 if q < (2 * n + 1) % n else 0) for q in range(n)]
    for op in ([hvd.Sum, hvd.Max] if dtype == torch.bool else [hvd.Sum, hvd.Average, hvd.Min]):
        got = hvd.reducescatter(big[r], op=op, name=f"{tag}.rs.{op}")
        start = sum(per[:r])
        assert_close(got, reduce_ref(big, op)[start:start + per[r]], f"reducescatter {dtype}")


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.uint32,
                                   torch.float8_e4m3fn],
                         ids=["complex64", "uint16", "uint32", "float8_e4m3fn"])
def test_unsupported_dtype_is_a_value_error(initialized, dtype):
    t = torch.zeros(2, dtype=dtype)
    for call in (lambda: hvd.allreduce(t, op=hvd.Sum), lambda: hvd.allgather(t),
                 lambda: hvd.broadcast(t, 0)):
        with pytest.raises(ValueError, match="not supported"):
            call()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item() == _n()


def test_bool_cannot_be_averaged_or_scaled(initialized):
    b = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="bool"):
        hvd.allreduce(b)  # default op: Average
    with pytest.raises(ValueError, match="bool"):
        hvd.allreduce(b, op=hvd.Sum, prescale_factor=2.0)


# ------------------------------------------------------------------ allgather / broadcast

def test_allgather_different_rows_and_zero_rows(initialized):
    r, n = hvd.rank(), _n()
    t = torch.full((r, 3), float(r))  # rank 0 contributes no rows
    out = hvd.allgather(t, name="ag.zero")
    assert out.shape == (n * (n - 1) // 2, 3)
    assert out[:, 0].tolist() == [float(q) for q in range(n) for _ in range(q)]
    h = hvd.allgather_async(torch.full((r + 1,), float(r)), name="ag.async")
    assert hvd.synchronize(h).tolist() == [float(q) for q in range(n) for _ in range(q + 1)]
    outs = hvd.grouped_allgather([torch.ones(r + 1), torch.zeros(1, 2)], name="gag")
    assert outs[0].shape == (n * (n + 1) // 2,) and outs[1].shape == (n, 2)
    outs = sync_group(hvd.grouped_allgather_async([torch.full((1,), float(r))], name="gag.a"))
    assert outs[0].tolist() == [float(q) for q in range(n)]
    with pytest.raises(RuntimeError, match="rank 0 has"):  # trailing dims must agree
        hvd.allgather(torch.ones(2, 1 + r), name="ag.mismatch")


def test_broadcast_every_flavour_and_root(initialized):
    r, n = hvd.rank(), _n()
    for root in range(n):
        mine = torch.full((3,), float(r))
        out = hvd.broadcast(mine, root, name=f"bc.{root}")
        assert out.tolist() == [float(root)] * 3 and mine.tolist() == [float(r)] * 3
        inplace = torch.full((3,), float(r))
        assert hvd.broadcast_(inplace, root_rank=root, name=f"bc_.{root}") is inplace
        assert inplace.tolist() == [float(root)] * 3
        mine = torch.full((2,), float(r))
        h = hvd.broadcast_async(mine, root, name=f"bca.{root}")
        assert hvd.synchronize(h).tolist() == [float(root)] * 2 and mine[0] == r
        h = hvd.broadcast_async_(mine, root, name=f"bca_.{root}")
        hvd.synchronize(h)
        assert mine.tolist() == [float(root)] * 2
    for bad in (n, -1):  # refused on every rank, as Horovod's RuntimeError
        with pytest.raises(RuntimeError, match="root_rank"):
            hvd.broadcast(torch.ones(1), bad)
    with pytest.raises(ValueError, match="contiguous"):  # in place needs contiguous memory
        hvd.broadcast_(torch.ones(3, 2).t(), 0)
    with pytest.raises(RuntimeError, match="rank 0 has 0"):  # ranks name different roots
        hvd.broadcast(torch.ones(1), r, name="bc.root_mismatch")


# ------------------------------------------------------------------ alltoall / reducescatter

def test_alltoall_splits_zero_splits_and_no_splits(initialized):
    r, n = hvd.rank(), _n()
    # No splits: an even split, and only the output comes back.
    t = torch.arange(2.0 * n) + 100 * r
    out = hvd.alltoall(t, name="a2a.even")
    assert out.tolist() == [100.0 * q + 2 * r + i for q in range(n) for i in range(2)]
    # Splits with zeros: everything goes to the last rank.
    splits = [0] * (n - 1) + [3]
    out, received = hvd.alltoall(torch.full((3, 2), float(r)), splits=splits, name="a2a.zero")
    if r == n - 1:
        assert out.shape == (3 * n, 2) and received.tolist() == [3] * n
    else:
        assert out.shape == (0, 2) and received.tolist() == [0] * n
    assert received.dtype == torch.int32
    # Nothing at all to send.
    out, received = hvd.alltoall(torch.empty(0, 2), splits=[0] * n, name="a2a.none")
    assert out.shape == (0, 2) and received.tolist() == [0] * n
    # Splits as a tensor, and the async flavour (synchronize gives output and splits).
    h = hvd.alltoall_async(torch.arange(float(n)), splits=torch.ones(n, dtype=torch.int32),
                           name="a2a.async")
    out, received = hvd.synchronize(h)
    assert out.tolist() == [float(r)] * n and received.tolist() == [1] * n


def test_alltoall_bad_splits_are_value_errors(initialized):
    n = _n()
    for splits, text in [([1] * (n + 1), "entries"), ([-1] + [2] * (n - 1), "non-negative"),
                         ([5] + [1] * (n - 1), "sum")]:
        with pytest.raises(ValueError, match=text):
            hvd.alltoall(torch.ones(n), splits=splits)
    with pytest.raises(ValueError, match="divisible"):
        hvd.alltoall(torch.ones(n + 1))
    with pytest.raises(ValueError):
        hvd.alltoall(torch.tensor(1.0))
    out = hvd.alltoall(torch.ones(n), name="a2a.after")  # nothing was sent: still fine
    assert out.tolist() == [1.0] * n


def test_reducescatter_ops_async_and_grouped(initialized):
    r, n = hvd.rank(), _n()
    inputs = everyone((2 * n, 3), torch.float32, seed=5)
    for name, op in REDUCE_OPS.items():
        got = hvd.reducescatter(inputs[r], op=op, name=f"rs.{name}")
        assert_close(got, reduce_ref(inputs, op)[2 * r:2 * r + 2], f"reducescatter {name}")
    assert_close(hvd.reducescatter(inputs[r], name="rs.default"),  # default op: Average
                 reduce_ref(inputs, hvd.Average)[2 * r:2 * r + 2])
    h = hvd.reducescatter_async(inputs[r], op=hvd.Sum, name="rs.async")
    assert_close(hvd.synchronize(h), reduce_ref(inputs, hvd.Sum)[2 * r:2 * r + 2])
    got = hvd.reducescatter(torch.ones(2 * n), op=hvd.Sum, prescale_factor=2.0,
                            postscale_factor=0.5, name="rs.scaled")
    assert got.tolist() == [float(n)] * 2
    outs = hvd.grouped_reducescatter([inputs[r], inputs[r][:, :1]], op=hvd.Max, name="grs")
    assert_close(outs[1], reduce_ref([t[:, :1] for t in inputs], hvd.Max)[2 * r:2 * r + 2])
    outs = sync_group(hvd.grouped_reducescatter_async([torch.ones(n, 2)], op=hvd.Sum,
                                                      name="grs.async"))
    assert outs[0].tolist() == [[float(n)] * 2]
    # One row for two ranks: rank 0 gets it, the others get zero rows.
    got = hvd.reducescatter(torch.ones(1, 2), op=hvd.Sum, name="rs.one_row")
    assert got.shape == ((1, 2) if r == 0 else (0, 2))


# ------------------------------------------------------------------ grouped allreduce

def test_grouped_allreduce_every_flavour(initialized):
    r, n = hvd.rank(), _n()
    mk = lambda: [torch.full((k + 1,), float(r + k)) for k in range(4)]  # noqa: E731
    want = [[float(sum(q + k for q in range(n)))] * (k + 1) for k in range(4)]
    assert [o.tolist() for o in hvd.grouped_allreduce(mk(), op=hvd.Sum, name="g")] == want
    ts = mk()
    outs = hvd.grouped_allreduce_(ts, op=hvd.Sum, name="g_")
    assert [t.tolist() for t in ts] == want and all(o is t for o, t in zip(outs, ts))
    outs = sync_group(hvd.grouped_allreduce_async(mk(), op=hvd.Sum, name="ga"))
    assert [o.tolist() for o in outs] == want
    ts = mk()
    sync_group(hvd.grouped_allreduce_async_(ts, op=hvd.Sum, name="ga_"))
    assert [t.tolist() for t in ts] == want
    # Mixed dtypes in one group, an empty group, unnamed groups.
    outs = hvd.grouped_allreduce([torch.ones(2), torch.ones(2, dtype=torch.int32)], op=hvd.Sum)
    assert outs[0].tolist() == [float(n)] * 2 and outs[1].tolist() == [n] * 2
    assert hvd.grouped_allreduce([]) == []
    with pytest.raises(RuntimeError, match="group"):  # ranks disagree on the group
        hvd.grouped_allreduce([torch.ones(1)] * (1 + r), name="g.mismatch")


def test_grouped_async_returns_one_handle_for_the_group(initialized):
    n = _n()
    handle = hvd.grouped_allreduce_async([torch.ones(2), torch.ones(3)], op=hvd.Sum,
                                         name="g.one_handle")
    try:
        assert hvd.poll(handle) in (True, False)
        outs = hvd.synchronize(handle)
        assert [o.tolist() for o in outs] == [[float(n)] * 2, [float(n)] * 3]
    finally:
        for h in handle if isinstance(handle, list) else []:
            hvd.synchronize(h)  # drain what horovod_torch handed out


# ------------------------------------------------------------------ barrier, join, poll

def test_barrier(initialized):
    r = hvd.rank()
    hvd.barrier()  # the ranks start the timed barrier together, whatever ran before
    if r == 0:
        time.sleep(0.5)
    t0 = time.monotonic()
    hvd.barrier()
    waited = time.monotonic() - t0
    # Everyone but rank 0 waited for rank 0's late arrival.
    assert r == 0 or waited > 0.2, waited
    hvd.barrier(process_set=hvd.global_process_set)


def test_join_returns_last_rank_and_joined_ranks_contribute_zeros(initialized):
    r, n = hvd.rank(), _n()
    steps = r + 2  # rank r has r + 2 batches
    for i in range(steps):
        active = sum(1 for q in range(n) if q + 2 > i)
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"join.sum.{i}").tolist() == \
            [float(active)] * 2
        # Average still divides by size(): joined ranks count as zeros.
        avg = hvd.allreduce(torch.ones(1), name=f"join.avg.{i}")
        assert abs(avg.item() - active / n) < 1e-6
    last = hvd.join()
    assert last == n - 1  # the rank with the most data joined last
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="join.after").item() == n


def test_poll_and_synchronize(initialized):
    n = _n()
    handles = [hvd.allreduce_async(torch.full((1000,), float(i)), op=hvd.Sum, name=f"p.{i}")
               for i in range(10)]
    for i, h in enumerate(handles):
        deadline = time.monotonic() + 30
        while not hvd.poll(h):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert hvd.poll(h) is True
        assert hvd.synchronize(h)[0].item() == float(i * n)
    # A synchronized handle is gone (Horovod returns None here; horovod_torch says why).
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.synchronize(handles[0])
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.poll(handles[0])


# ------------------------------------------------------------------ empty and 0-d tensors

def test_empty_tensors_work_for_every_collective(initialized):
    n = _n()
    e = torch.empty(0)
    assert hvd.allreduce(e, name="e.ar").shape == (0,)
    assert hvd.allreduce(torch.empty(0, 3), op=hvd.Sum, name="e.ar2").shape == (0, 3)
    assert hvd.allreduce_(torch.empty(0), name="e.ar_").shape == (0,)
    assert hvd.grouped_allreduce([e, torch.ones(1)], op=hvd.Sum, name="e.gar")[1].item() == n
    assert hvd.allgather(e, name="e.ag").shape == (0,)
    assert hvd.broadcast(e, 0, name="e.bc").shape == (0,)
    assert hvd.alltoall(e, name="e.a2a").shape == (0,)
    assert hvd.reducescatter(e, name="e.rs").shape == (0,)
    assert hvd.allreduce(torch.empty(0), op=hvd.Adasum, name="e.ada").shape == (0,)


def test_scalar_tensors(initialized):
    r, n = hvd.rank(), _n()
    s = torch.tensor(float(r + 1))
    out = hvd.allreduce(s, op=hvd.Sum, name="s.ar")
    assert out.shape == () and out.item() == n * (n + 1) / 2
    out = hvd.broadcast(s, n - 1, name="s.bc")
    assert out.shape == () and out.item() == float(n)
    assert hvd.allreduce(torch.tensor(2.0), op=hvd.Adasum, name="s.ada").item() == 2.0
    # Collectives along dimension 0 need one: a clear ValueError, nothing is sent.
    with pytest.raises(ValueError, match="dimension"):
        hvd.allgather(s)
    with pytest.raises(ValueError, match="dimension"):
        hvd.reducescatter(s)
    with pytest.raises(ValueError):
        hvd.alltoall(s)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="s.after").item() == n


# ------------------------------------------------------------------ errors

def test_duplicate_name_in_flight_is_a_value_error(initialized):
    r = hvd.rank()
    if r != 0:
        time.sleep(0.5)  # rank 0's first submission is certainly still pending
    h = hvd.allreduce_async(torch.ones(2), name="dup")
    if r == 0:
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(torch.ones(2), name="dup")
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allgather_async(torch.ones(2), name="dup")
    assert hvd.synchronize(h).tolist() == [1.0, 1.0]
    h = hvd.allreduce_async(torch.ones(2), name="dup")  # free again once done
    hvd.synchronize(h)


@pytest.mark.parametrize("what", ["shape", "dtype", "op"])
def test_cross_rank_mismatch_is_a_runtime_error_naming_the_ranks(initialized, what):
    r, n = hvd.rank(), _n()
    name = f"mismatch.{what}"
    if what == "shape":
        call, texts = lambda: hvd.allreduce(torch.ones(2 + r), name=name), ["[2]", "[3]"]
    elif what == "dtype":
        dt = torch.float32 if r == 0 else torch.float64
        call, texts = lambda: hvd.allreduce(torch.ones(2, dtype=dt), name=name), \
            ["float32", "float64"]
    else:
        op = hvd.Sum if r == 0 else hvd.Max
        call, texts = lambda: hvd.allreduce(torch.ones(2), op=op, name=name), ["Sum", "Max"]
    with pytest.raises(RuntimeError) as info:
        call()
    msg = str(info.value)
    assert not isinstance(info.value, hvd.HorovodInternalError)  # the engine lives on
    for t in [name, "rank 0 has", "rank 1 has"] + texts:
        assert t in msg, msg
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"{name}.after").item() == n


def test_local_errors_are_value_errors(initialized):
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce_(torch.ones(4, 2).t())
    with pytest.raises(ValueError, match="torch.Tensor"):
        hvd.allreduce([1.0, 2.0])
    # Out-of-place collectives accept non-contiguous input.
    t = torch.arange(6.0).view(2, 3).t()
    assert torch.equal(hvd.allreduce(t, op=hvd.Max, name="noncontig"), t)
