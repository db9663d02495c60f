"""Process sets: static (init) and dynamic (add/remove), every collective, the
optimizer and helpers restricted to a set, and the errors."""
from tests.harness import run_workers


def test_static_process_sets_every_collective():
    run_workers("tests.process_set_workers:static_sets", 4, timeout=150)


def test_dynamic_process_sets_add_use_remove():
    run_workers("tests.process_set_workers:dynamic_sets", 3, timeout=120,
                env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
