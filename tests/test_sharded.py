"""DistributedOptimizer(shard_optimizer_state=...): exactness against the unsharded
optimizer, checkpoints and errors (CPU, 2 and 3 ranks)."""
import pytest

from tests.harness import run_workers


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
def test_sharded_training_equals_unsharded(size, opt):
    run_workers("tests.sharded_workers:exactness", size, args=[opt, "1", "none"], timeout=120)


@pytest.mark.parametrize("stage,extra", [
    (1, "clip"), (2, "clip"), (2, "none"), (1, "bpps2+fp16"), (1, "amp+clip"), (2, "amp"),
])
def test_sharded_training_options(stage, extra):
    run_workers("tests.sharded_workers:exactness", 3, args=["adamw", str(stage), extra],
                timeout=120)


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_state_dicts(size):
    run_workers("tests.sharded_workers:state_dicts", size, timeout=120)


def test_sharded_errors():
    run_workers("tests.sharded_workers:errors", 2, timeout=60)
