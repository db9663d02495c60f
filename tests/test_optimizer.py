"""DistributedOptimizer: exactness against one process, and user-visible behaviours."""
import pytest

from tests.harness import run_workers


@pytest.mark.parametrize("opt,op,bpps,extra", [
    ("sgd", "average", 1, "none"), ("adam", "average", 1, "none"), ("sgd", "sum", 1, "none"),
    ("adam", "sum", 2, "none"), ("sgd", "average", 2, "none"), ("sgd", "average", 1, "groups"),
    ("adam", "average", 1, "fp16"),
])
def test_exactness(opt, op, bpps, extra):
    run_workers("tests.optimizer_workers:exactness", 2, args=[opt, op, bpps, extra], timeout=90)


@pytest.mark.parametrize("opt,op,bpps,extra", [
    ("sgd", "average", 1, "none"), ("adam", "sum", 2, "none"), ("adam", "average", 1, "fp16"),
])
def test_exactness_python_hooks(opt, op, bpps, extra):
    # HOROVOD_NATIVE_GRAD_HOOKS=0: the gradient hooks run in Python.
    run_workers("tests.optimizer_workers:exactness", 2, args=[opt, op, bpps, extra], timeout=90,
                env={"HOROVOD_NATIVE_GRAD_HOOKS": "0"})


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp-hooks", "python-hooks"])
@pytest.mark.parametrize("bpps,extra", [(1, "compiled"), (2, "compiled+fp16"),
                                        (2, "torch.compile")])
def test_exactness_under_torch_compile(native, bpps, extra):
    # compiled: torch._dynamo.compiled_autograd runs hooks from the graph it builds;
    # torch.compile: the model is compiled (aot_eager), backward runs eagerly.
    import torch
    if (native == "1" and "compiled" in extra
            and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 9)):
        pytest.skip("the C++ hooks support compiled autograd from torch 2.9")
    run_workers("tests.optimizer_workers:exactness", 2, args=["sgd", "average", bpps, extra],
                timeout=180, env={"HOROVOD_NATIVE_GRAD_HOOKS": native})


def test_exactness_three_ranks_adam():
    run_workers("tests.optimizer_workers:exactness", 3, args=["adam", "average", 1, "none"],
                timeout=90)


@pytest.mark.parametrize("native", ["1", "0"])
def test_fp16_compression_sends_float16(native):
    run_workers("tests.optimizer_workers:fp16_wire", 2, timeout=90,
                env={"HOROVOD_NATIVE_GRAD_HOOKS": native})


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp-hooks", "python-hooks"])
def test_a_pass_too_many_raises_on_either_hook_path(native):
    results = run_workers("tests.optimizer_workers:extra_pass", 2, timeout=90,
                          env={"HOROVOD_NATIVE_GRAD_HOOKS": native})
    assert all("extra pass ok" in r.output for r in results)


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp-hooks", "python-hooks"])
def test_a_dropped_optimizer_is_freed_with_its_model(native):
    run_workers("tests.optimizer_workers:freed_when_dropped", 2, timeout=90,
                env={"HOROVOD_NATIVE_GRAD_HOOKS": native})


@pytest.mark.parametrize("shard", ["0", "1", "2", "rs"])
def test_step_with_a_closure_steps_on_reduced_gradients(shard):
    run_workers("tests.optimizer_workers:closures", 2, args=[shard], timeout=90)


@pytest.mark.parametrize("native", ["1", "0"])
def test_optimizer_behaviours(native):
    run_workers("tests.optimizer_workers:behaviours", 2, timeout=90,
                env={"HOROVOD_NATIVE_GRAD_HOOKS": native})


@pytest.mark.parametrize("size", [2, 4, 3])
def test_adasum_over_tcp(size):
    run_workers("tests.optimizer_workers:adasum_checks", size, timeout=120)
