"""Worker functions for tests/test_process_sets.py (run by tests.harness)."""
import os

import torch

import horovod_torch as hvd


def _expect(exc, fn, *texts):
    try:
        fn()
    except exc as e:
        for t in texts:
            assert t in str(e), f"{t!r} not in {e}"
        return
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def static_sets() -> None:
    """4 ranks: even [0, 2], odd [1, 3], a singleton [3], registered at init."""
    even, odd, one = hvd.ProcessSet([2, 0]), hvd.ProcessSet([1, 3]), hvd.ProcessSet([3])
    assert even.process_set_id is None and even.size() is None
    hvd.init(process_sets=[even, odd, one])
    r = hvd.rank()
    assert hvd.size() == 4
    ids = {even.process_set_id, odd.process_set_id, one.process_set_id}
    assert len(ids) == 3 and 0 not in ids, ids
    mine, other = (even, odd) if r % 2 == 0 else (odd, even)
    assert mine.ranks == ([0, 2] if r % 2 == 0 else [1, 3])
    assert mine.size() == 2 and mine.rank() == r // 2 and mine.included()
    assert other.rank() == -1 and not other.included()
    assert one.included() == (r == 3) and one.size() == 1
    assert hvd.global_process_set.size() == 4 and hvd.global_process_set.rank() == r
    assert mine != other and mine == mine and hvd.global_process_set != mine

    members = mine.ranks
    # allreduce: sum and average over the set's members only.
    t = torch.tensor([float(r + 1)] * 5)
    assert torch.all(hvd.allreduce(t, op=hvd.Sum, process_set=mine) == sum(m + 1 for m in members))
    avg = hvd.allreduce(t, process_set=mine, name="avg")
    assert torch.allclose(avg, torch.full((5,), sum(m + 1 for m in members) / 2))
    # Interleaved with global ops, unnamed, async: names and order stay consistent.
    h_set = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, process_set=mine)
    h_all = hvd.allreduce_async(torch.ones(3), op=hvd.Sum)
    h_set2 = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, process_set=mine)
    assert torch.all(hvd.synchronize(h_all) == 4)
    assert torch.all(hvd.synchronize(h_set) == 2) and torch.all(hvd.synchronize(h_set2) == 2)
    # allgather in set-rank order, rows differ per rank.
    g = hvd.allgather(torch.full((r + 1, 2), float(r)), process_set=mine)
    want = torch.cat([torch.full((m + 1, 2), float(m)) for m in members])
    assert torch.equal(g, want), g
    # broadcast: root_rank is a global rank (as in Horovod) and must be a member.
    b = hvd.broadcast(torch.tensor([float(r)]), root_rank=members[1], process_set=mine)
    assert b.item() == members[1]
    _expect(ValueError, lambda: hvd.broadcast(torch.zeros(1), root_rank=other.ranks[0],
                                              process_set=mine), "is not in")
    # alltoall: one split per set member.
    me = mine.rank()
    out, rsplits = hvd.alltoall(torch.tensor([float(r), float(r) + 0.5, float(r) + 0.25]),
                                splits=[1, 2] if me == 0 else [2, 1], process_set=mine)
    assert rsplits.tolist() == ([1, 2] if me == 0 else [2, 1])
    _expect(ValueError, lambda: hvd.alltoall(torch.zeros(4), splits=[1, 1, 1, 1],
                                             process_set=mine), "entries")
    # reducescatter within the set.
    rs = hvd.reducescatter(torch.full((4, 1), float(r)), op=hvd.Sum, process_set=mine)
    assert rs.shape == (2, 1) and torch.all(rs == sum(members))
    # grouped ops.
    outs = hvd.grouped_allreduce([torch.ones(2), torch.ones(3) * 2], op=hvd.Sum,
                                 process_set=mine)
    assert torch.all(outs[0] == 2) and torch.all(outs[1] == 4)
    # autograd through a set allreduce.
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x * (r + 1), op=hvd.Sum, process_set=mine).sum()).backward()
    # d/dx of sum(allreduce_sum(x * (r + 1))): the gradient is allreduced over the set.
    assert torch.allclose(x.grad, torch.full((3,), float(len(members) * (r + 1)))), x.grad
    # A singleton set: the op is the identity for its only member.
    if r == 3:
        assert torch.all(hvd.allreduce(torch.ones(2) * 7, op=hvd.Sum, process_set=one) == 7)
        hvd.barrier(process_set=one)
    # Non-members are refused with a clear error, nothing is sent.
    _expect(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=other),
            f"rank {r} is not in")
    # Mismatch inside a set: shapes differ between its two members.
    _expect(RuntimeError, lambda: hvd.allreduce(torch.ones(2 + me), name="bad",
                                               process_set=mine),
            "Mismatched tensor shapes", "rank 0 has [2]", "rank 1 has [3]")
    # Objects, parameters and optimizer state within a set.
    obj = hvd.broadcast_object({"from": r}, root_rank=members[0], process_set=mine)
    assert obj == {"from": members[0]}
    assert hvd.allgather_object(r, process_set=mine) == members
    # DistributedOptimizer per set: each set trains on its own data; parameters agree
    # within a set and differ between sets.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=members[0], process_set=mine)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=mine)
    torch.manual_seed(100 + r)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4) * (1 + (r % 2))).pow(2).mean().backward()
        opt.step()
    w = model.weight.detach().flatten()
    gathered = hvd.allgather(w.unsqueeze(0))
    assert torch.allclose(gathered[r], gathered[members[0] if r != members[0] else members[1]])
    assert not torch.allclose(gathered[0], gathered[1])
    hvd.barrier(process_set=mine)
    hvd.barrier()
    hvd.shutdown()


def dynamic_sets() -> None:
    """3 ranks, HOROVOD_DYNAMIC_PROCESS_SETS=1: add, use, reject, remove, re-add."""
    hvd.init()
    r = hvd.rank()
    os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS")
    _expect(ValueError, lambda: hvd.add_process_set([0, 1]), "HOROVOD_DYNAMIC_PROCESS_SETS=1")
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    ps = hvd.add_process_set([0, 2])
    assert ps.process_set_id == 1 and ps.ranks == [0, 2]
    if r in (0, 2):
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps).item() == 2
    _expect(ValueError, lambda: hvd.add_process_set(hvd.ProcessSet([2, 0])), "already has")
    _expect(ValueError, lambda: hvd.add_process_set([0, 5]), "in [0, 3)")
    _expect(ValueError, lambda: hvd.ProcessSet([0, 0]), "distinct")
    _expect(ValueError, lambda: hvd.ProcessSet(["a"]), "integers")
    # Ranks that disagree on the set: every rank gets the mismatch, naming both views.
    _expect(RuntimeError, lambda: hvd.add_process_set([0, 1] if r == 0 else [0, 1, 2]),
            "Mismatched process sets to add", "rank 0 has [0, 1]", "rank 1 has [0, 1, 2]")
    solo = hvd.add_process_set([1])
    if r == 1:
        assert hvd.allreduce(torch.ones(1) * 3, op=hvd.Sum, process_set=solo).item() == 3
    assert hvd.remove_process_set(ps)
    assert ps.process_set_id is None
    _expect(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=ps), "not registered")
    assert not hvd.remove_process_set(ps)
    assert not hvd.remove_process_set(hvd.global_process_set)
    again = hvd.add_process_set([0, 2])
    assert again.process_set_id not in (None, 0, 1, solo.process_set_id)
    if r in (0, 2):
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=again).item() == 2
    assert sorted(hvd._C.process_sets()) == sorted([0, solo.process_set_id,
                                                    again.process_set_id])
    hvd.barrier()
    hvd.shutdown()
    # A fresh init forgets every set.
    hvd.init()
    assert again.process_set_id is None and solo.process_set_id is None
    assert sorted(hvd._C.process_sets()) == [0]
    third = hvd.add_process_set([1, 2])
    assert third.process_set_id == 1
    hvd.barrier()
    hvd.shutdown()


def gpu_sets() -> None:
    """2 ranks with a GPU each: NCCL communicators per process set (singletons),
    interleaved with global CUDA and CPU ops; a static set of every rank is the global
    set."""
    pair, solo0, solo1 = hvd.ProcessSet([0, 1]), hvd.ProcessSet([0]), hvd.ProcessSet([1])
    hvd.init(process_sets=[pair, solo0, solo1])
    assert pair.process_set_id == 0 and pair == hvd.global_process_set
    r = hvd.rank()
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", hvd.local_rank())
    mine = solo0 if r == 0 else solo1
    for step in range(5):
        a = hvd.allreduce_async(torch.full((1000,), float(r + 1), device=dev), op=hvd.Sum,
                                process_set=pair)
        b = hvd.allreduce_async(torch.full((10,), float(r + 1), device=dev), op=hvd.Sum)
        c = hvd.allreduce_async(torch.full((7,), float(r + 5), device=dev), op=hvd.Sum,
                                process_set=mine)
        d = hvd.allreduce_async(torch.full((3,), 2.0), op=hvd.Sum, process_set=pair)
        assert torch.all(hvd.synchronize(a) == 3) and torch.all(hvd.synchronize(b) == 3)
        assert torch.all(hvd.synchronize(c) == r + 5) and torch.all(hvd.synchronize(d) == 4)
    g = hvd.allgather(torch.full((r + 1, 2), float(r), device=dev), process_set=pair)
    assert g.shape == (3, 2) and g.is_cuda
    bc = hvd.broadcast(torch.full((4,), float(r), device=dev), root_rank=1, process_set=pair)
    assert torch.all(bc == 1)
    hvd.barrier()
    hvd.shutdown()


def mpi_comm_subset() -> None:
    """Under mpirun with 3 processes: init(comm=[0, 2]) makes a world of two; the
    rank outside gets a clear ValueError."""
    import horovod_torch as h
    world_rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    try:
        h.init(comm=[0, 2])
    except ValueError as e:
        assert world_rank == 1 and "not in the given ranks" in str(e), (world_rank, e)
        print("outside as expected", flush=True)
        return
    assert world_rank in (0, 2) and h.size() == 2 and h.rank() == world_rank // 2
    assert h.mpi_enabled() and not h.gloo_enabled()
    assert h.allreduce(torch.ones(2), op=h.Sum).tolist() == [2.0, 2.0]
    h.shutdown()


def mpi4py_comm() -> None:
    """init(comm=<mpi4py communicator>): the job runs on that communicator (here the
    even and odd halves of 4 processes form two separate jobs of 2), and the script's
    own mpi4py calls work alongside (MPI_THREAD_MULTIPLE)."""
    from mpi4py import MPI
    import horovod_torch as h
    world = MPI.COMM_WORLD
    half = world.Split(color=world.Get_rank() % 2, key=world.Get_rank())
    h.init(comm=half)
    assert h.size() == 2 and h.rank() == world.Get_rank() // 2
    assert h.mpi_enabled() and h.mpi_threads_supported()
    got = h.allreduce(torch.tensor([float(world.Get_rank())]), op=h.Sum).item()
    assert got == (2.0 if world.Get_rank() % 2 == 0 else 4.0), got
    assert world.allreduce(1) == world.Get_size()  # the script's own MPI traffic
    h.shutdown()


def mpi_world_probe() -> None:
    """Prints how the job came up (horovodrun --mpi test)."""
    hvd.init()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    print(f"MPI WORLD size={hvd.size()} mpi={hvd.mpi_enabled()} sum={total}", flush=True)
    hvd.shutdown()
