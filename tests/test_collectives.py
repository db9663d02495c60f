"""Every collective x dtype on 1-4 real processes against a one-process reference."""
import pytest

from tests.harness import run_workers


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_all_collectives_all_dtypes(size):
    results = run_workers("tests.workers:all_collectives", size, args=[size], timeout=150)
    assert all("all collectives ok" in r.output for r in results)


@pytest.mark.parametrize("size", [2, 3])
def test_out_of_order_hundreds_of_tensors_grouped_and_unnamed(size):
    run_workers("tests.workers:out_of_order_and_many", size, timeout=90)


def test_unnamed_ops_from_two_threads_are_not_paired_across_threads():
    run_workers("tests.workers:unnamed_from_threads", 2, timeout=120)


def test_autograd_through_collectives():
    run_workers("tests.workers:autograd", 3, timeout=90)


def test_collectives_under_inference_mode():
    run_workers("tests.workers:inference_mode", 2, timeout=90)


def test_broadcast_and_allgather_objects():
    run_workers("tests.workers:objects", 3, timeout=90)


def test_fusion_disabled_and_cache_disabled_give_same_results():
    env = {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CACHE_CAPACITY": "0"}
    run_workers("tests.workers:out_of_order_and_many", 2, env=env, timeout=90)


def test_small_cache_with_evictions():
    run_workers("tests.workers:out_of_order_and_many", 2, env={"HOROVOD_CACHE_CAPACITY": "7"},
                timeout=90)


@pytest.mark.parametrize("size", [2, 3])
def test_join_with_uneven_data(size):
    run_workers("tests.workers:join_uneven", size, timeout=90)


@pytest.mark.parametrize("size", [2, 4])
def test_ops_beside_a_join_fail_at_once(size):
    run_workers("tests.workers:join_beside_other_ops", size, timeout=90)


@pytest.mark.parametrize("knob,control", [("1", "1"), ("0", "1"), ("1", "0")])
def test_all_collectives_with_shared_memory_always_or_never(knob, control):
    """knob 1: every size through the host's shared-memory segment; 0: flat TCP only
    (the default, -1, switches between them at 64 KB). control: negotiation through
    the segment (1, the default on one host) or over TCP (0)."""
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": knob, "HOROVOD_HIERARCHICAL_ALLGATHER": knob,
           "HOROVOD_SHM_CONTROL": control}
    results = run_workers("tests.workers:all_collectives", 3, args=[3], env=env, timeout=150)
    assert all("all collectives ok" in r.output for r in results)
