"""The torch.distributed backend "hvd" (horovod_torch/integrations/torch_distributed.py,
csrc/python/c10d_backend.cc): real processes started as torchrun starts them, with
gloo over the same ranks as the reference."""
import os
import re
import subprocess
import sys

import pytest

from tests.harness import ROOT, WorkerResult, describe, held_master_port, master_port


def _run(target, size, args=(), timeout=120, expect_ok=True, env=None):
    port = master_port()
    procs = []
    for rank in range(size):
        e = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        e.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                 PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.run_worker", target,
                                       *map(str, args)], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    results = []
    try:
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout)
            results.append(WorkerResult(rank, p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [WorkerResult(r, None, p.communicate()[0]) for r, p in enumerate(procs)]
        raise AssertionError(f"not finished within {timeout} s:\n" + describe(outs))
    if expect_ok:
        bad = [r.rank for r in results if r.returncode != 0]
        assert not bad, f"ranks {bad} failed:\n" + describe(results)
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_every_collective_matches_gloo(size):
    results = _run("tests.torch_distributed_workers:collectives", size)
    for r in results:
        assert f"OK rank={r.rank}" in r.output, describe(results)
        # 30 rounds of x = sum(x) + 1 from zero, on every rank.
        value = 0
        for _ in range(30):
            value = value * size + 1
        assert f"REPEATS rank={r.rank} value={value}" in r.output, describe(results)


@pytest.mark.parametrize("size", [2, 3])
def test_ddp_trains_as_on_gloo(size):
    results = _run("tests.torch_distributed_workers:ddp", size)
    for r in results:
        m = re.search(r"DDP rank=\d+ size=\d+ diff=(\S+)", r.output)
        assert m, describe(results)
        if size == 2:  # a sum of two is the same in any order: bitwise
            assert float(m.group(1)) == 0.0, describe(results)
        else:
            assert float(m.group(1)) < 1e-5, describe(results)


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_ddp_compression_hooks_train_as_on_gloo(hook):
    # DDP's own hooks: an all_reduce of the compressed bucket, a future chained on it.
    results = _run("tests.torch_distributed_workers:ddp", 2, ["cpu", "20", hook])
    for r in results:
        m = re.search(r"DDP rank=\d+ size=\d+ diff=(\S+)", r.output)
        assert m and float(m.group(1)) == 0.0, describe(results)


def test_future_callbacks_may_wait_and_calls_inside_them_are_refused():
    results = _run("tests.torch_distributed_workers:future_callbacks", 2, timeout=90)
    for r in results:
        assert f"REFUSED rank={r.rank}" in r.output, describe(results)


@pytest.mark.parametrize("size", [2, 3])
def test_fsdp2_matches_one_process(size):
    results = _run("tests.torch_distributed_workers:fsdp2", size, timeout=180)
    for r in results:
        m = re.search(r"FSDP2 rank=\d+ size=\d+ replicas=1 diff=(\S+)", r.output)
        assert m, describe(results)
        assert float(m.group(1)) < 1e-4, describe(results)


@pytest.mark.parametrize("size", [2, 3])
def test_premul_sum_scales_each_ranks_tensor_before_the_sum(size):
    results = _run("tests.torch_distributed_workers:premul_sum", size)
    assert all(f"OK rank={r.rank}" in r.output for r in results), describe(results)


@pytest.mark.parametrize("late,wait_all,named", [("1", "0", "Rank 1 failed"),
                                                  ("1,2", "0", "Rank 1 failed"),
                                                  ("1,2", "1", "Ranks 1, 2 failed")])
def test_monitored_barrier_names_the_ranks_that_did_not_reach_it(late, wait_all, named):
    results = _run("tests.torch_distributed_workers:monitored_barrier", 3, [late, wait_all],
                   timeout=120)
    assert all(f"OK rank={r.rank}" in r.output for r in results), describe(results)
    assert (f"[Rank 0]: {named} to pass monitoredBarrier in 500 ms"
            in results[0].output), describe(results)
    for r in results[1:]:
        assert (f"Rank {r.rank} reached monitored_barrier, but rank 0 did not answer"
                in r.output), describe(results)


def test_fsdp2_checkpoints_with_dcp_and_reshards_on_load(tmp_path):
    # torch.distributed.checkpoint saves and loads FSDP2's sharded model and optimizer
    # through the backend's collectives; saved at 3 ranks, loaded at 2 (as an elastic
    # job's survivors would).
    for size, mode in ((3, "save"), (2, "load")):
        results = _run("tests.torch_distributed_workers:fsdp2_checkpoint", size,
                       [tmp_path, mode], timeout=180)
        for r in results:
            assert f"DCP rank={r.rank} size={size} {mode} ok" in r.output, describe(results)


def test_fsdp2_with_a_gradient_divide_factor_matches_one_process():
    # FSDP2 reduce-scatters with PREMUL_SUM(1 / factor) then (gloo refuses it).
    results = _run("tests.torch_distributed_workers:fsdp2", 2, ["cpu", "10", "1", "8"],
                   timeout=180)
    for r in results:
        m = re.search(r"FSDP2 rank=\d+ size=2 replicas=1 diff=(\S+)", r.output)
        assert m, describe(results)
        assert float(m.group(1)) < 1e-4, describe(results)


def test_fsdp2_hsdp_on_a_2d_device_mesh_matches_one_process():
    results = _run("tests.torch_distributed_workers:fsdp2", 4, ["cpu", "10", "2"], timeout=240)
    for r in results:
        m = re.search(r"FSDP2 rank=\d+ size=4 replicas=2 diff=(\S+)", r.output)
        assert m, describe(results)
        assert float(m.group(1)) < 1e-4, describe(results)


def test_hvd_and_dist_calls_share_one_engine():
    results = _run("tests.torch_distributed_workers:mixed", 2)
    assert all(f"OK rank={r.rank}" in r.output for r in results), describe(results)


def test_bad_calls_raise_clear_errors_and_the_group_goes_on():
    results = _run("tests.torch_distributed_workers:errors", 2)
    for r in results:
        assert f"OK rank={r.rank}" in r.output, describe(results)
        assert re.search(rf"MISMATCH rank={r.rank} \w+: .*(shape|Mismatched)", r.output), \
            describe(results)


def test_mismatched_repeats_fail_at_once_and_only_the_call_that_differs():
    results = _run("tests.torch_distributed_workers:errors", 2)
    for r in results:
        m = re.search(rf"CACHED_MISMATCH rank={r.rank} after=(\S+) \w+: .*Mismatched tensor "
                      r"shapes.*rank 0 has \[6\], rank 1 has \[7\]", r.output)
        assert m, describe(results)
        assert float(m.group(1)) < 5, describe(results)  # not the stall inspector's 60 s


def test_repeated_calls_and_ddp_steps_skip_negotiation():
    results = _run("tests.torch_distributed_workers:repeats", 2)
    for r in results:
        assert f"OK rank={r.rank}" in r.output, describe(results)
        m = re.search(rf"ALL_REDUCE rank={r.rank} negotiated=(\d+) cached=(\d+)", r.output)
        assert m, describe(results)
        # Each of the 8 slots' names is negotiated once (core/c10d_names.h).
        assert int(m.group(1)) <= 8 and int(m.group(2)) >= 12, describe(results)
        m = re.search(rf"DDP rank={r.rank} negotiated=(\d+) cached=(\d+)", r.output)
        assert m, describe(results)
        assert int(m.group(1)) == 0 and int(m.group(2)) >= 5, describe(results)


@pytest.mark.parametrize("how,code", [("exit", 3), ("raise", 1)])
def test_a_dead_peer_fails_pending_work_and_survivors_rebuild_the_group(how, code):
    with held_master_port() as new_port:  # the survivors' group, seconds later
        results = _run("tests.torch_distributed_workers:peer_dies", 3, [new_port, "cpu", how],
                       expect_ok=False, timeout=120)
    assert results[2].returncode == code, describe(results)
    for r in results[:2]:
        assert r.returncode == 0, describe(results)
        m = re.search(r"FAILED rank=\d after=([\d.]+) (\w+)", r.output)
        assert m and m.group(2) == "DistBackendError", describe(results)
        assert float(m.group(1)) < 60, describe(results)
        assert f"REBUILT rank={r.rank} size=2 sum=3.0" in r.output, describe(results)


def test_rank_0_that_cannot_start_the_engine_fails_every_rank_at_once():
    results = _run("tests.torch_distributed_workers:rank0_cannot_start", 2, timeout=60)
    for r in results:
        m = re.search(r"REFUSED rank=\d after=([\d.]+) (\w+): (.*)", r.output)
        assert m and "loopback" in m.group(3), describe(results)
        assert float(m.group(1)) < 20, describe(results)


@pytest.mark.parametrize("size", [3, 4])
def test_groups_over_subsets_of_ranks_run_on_process_sets(size):
    results = _run("tests.torch_distributed_workers:subgroups", size, timeout=240)
    sets = set()
    for r in results:
        assert f"OK rank={r.rank}" in r.output, describe(results)
        m = re.search(r"SETS rank=\d+ (.*)", r.output)
        assert m, describe(results)
        sets.add(m.group(1))
    # The same registry everywhere: the global set, [0, last], [0, 1], [1, last].
    assert len(sets) == 1, describe(results)
    last = size - 1
    assert sets.pop() == str([(0, list(range(size))), (1, [0, last]), (2, [0, 1]),
                              (3, [1, last])]), describe(results)
    # The members of [0, last] ran every collective there, against gloo's group.
    value = 0
    for _ in range(30):
        value = value * 2 + 1
    for r in (results[0], results[last]):
        assert f"REPEATS rank={r.rank} value={value}" in r.output, describe(results)


def test_a_subgroup_without_the_engine_is_refused_clearly():
    results = _run("tests.torch_distributed_workers:subgroup_without_engine", 2, timeout=60)
    m = re.search(r"REFUSED rank=0 (.*)", results[0].output)
    assert m and "not running" in m.group(1), describe(results)


def test_a_late_member_of_a_new_group_is_the_one_reported_missing():
    results = _run("tests.torch_distributed_workers:subgroup_stall", 3, timeout=90,
                   env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    assert re.search(r"new_group': submitted by ranks \[0\], missing on ranks \[2\] ",
                     results[0].output), describe(results)


def test_a_receive_from_any_source_is_reported_waiting_for_a_send():
    results = _run("tests.torch_distributed_workers:any_source_stall", 2, timeout=90,
                   env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    assert re.search(r"p2pany\.0\.5\.0': a receive from any source on rank 0 has had no send "
                     r"to it with tag 5 for \d+ s", results[0].output), describe(results)
    assert "missing on ranks []" not in results[0].output, describe(results)


@pytest.mark.parametrize("size", [2, 3])
def test_send_and_recv_between_two_ranks(size):
    results = _run("tests.torch_distributed_workers:p2p", size, timeout=120)
    for r in results:
        assert f"OK rank={r.rank}" in r.output, describe(results)
    for r in results[:2]:
        assert re.search(rf"MISMATCH rank={r.rank} \w+: .*Mismatched", r.output), describe(results)
        assert re.search(rf"ANY_MISMATCH rank={r.rank} \w+: .*Mismatched tensor shapes",
                         r.output), describe(results)


def test_a_rank_that_exits_early_leaves_the_others_groups_running():
    results = _run("tests.torch_distributed_workers:early_exit", 3, timeout=90)
    assert "OK rank=2 exiting" in results[2].output, describe(results)
    for r in results[:2]:
        assert re.search(rf"OK rank={r.rank} calls=\d+", r.output), describe(results)


def test_a_rank_that_crashes_fails_the_others_at_once():
    results = _run("tests.torch_distributed_workers:crash", 3, timeout=60, expect_ok=False)
    assert results[2].returncode != 0, describe(results)
    for r in results[:2]:
        m = re.search(r"FAILED rank=\d after=([\d.]+) (\w+)", r.output)
        assert m and m.group(2) == "DistBackendError", describe(results)
        assert float(m.group(1)) < 20, describe(results)


def test_a_script_that_never_imports_horovod_torch_gets_hvd_from_torch():
    # torch's "torch.backends" entry point registers the name on `import torch`; the
    # backend's module and the extension load only when the group is created.
    results = _run("tests.c10d_plain_workers:plain_script", 2)
    for r in results:
        assert (f"PLAIN rank={r.rank} backend=hvd sum=3.0 engine=True before_init=[]"
                in r.output), describe(results)
    # torch's switch for its entry points turns it off.
    code = "import torch.distributed as d; print(hasattr(d.Backend, 'HVD'))"
    for autoload, want in (("1", "True"), ("0", "False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload},
                             timeout=120)
        assert out.stdout.strip() == want, (autoload, out.stdout, out.stderr)
