"""Scripts written for Horovod import names from horovod.torch, horovod.torch.mpi_ops,
horovod.torch.elastic(.state, .sampler) and horovod.common.*: every public name of
those Horovod 0.28 modules resolves here, and the horovod.common helpers behave as
Horovod's do. Needs no launcher (world-of-one tests call hvd.init() themselves)."""
import importlib
import os
import warnings

import pytest
import torch

import horovod
import horovod.torch as hvd

LAUNCHER_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "RANK", "SLURM_PROCID",
                 "HOROVOD_ELASTIC")

# The public names of each Horovod 0.28 module (read off its source: functions,
# classes, assignments and imported names; modules it imports, such as `torch` or
# `warnings`, are left out), and horovod.__version__.
UPSTREAM_NAMES = {
    "horovod": "run __version__",
    "horovod.torch": """
        Adasum Average Compression DistributedOptimizer HorovodInternalError Max Min
        ProcessSet Product Sum SyncBatchNorm add_process_set allgather allgather_async
        allgather_object allreduce allreduce_ allreduce_async allreduce_async_ alltoall
        alltoall_async barrier broadcast broadcast_ broadcast_async broadcast_async_
        broadcast_object broadcast_optimizer_state broadcast_parameters ccl_built
        check_extension cross_rank cross_size cuda_built ddl_built elastic
        global_process_set gloo_built gloo_enabled grouped_allgather
        grouped_allgather_async grouped_allreduce grouped_allreduce_
        grouped_allreduce_async grouped_allreduce_async_ grouped_reducescatter
        grouped_reducescatter_async init is_initialized join local_rank local_size
        mpi_built mpi_enabled mpi_threads_supported nccl_built poll rank reducescatter
        reducescatter_async remove_process_set rocm_built shutdown size
        sparse_allreduce_async start_timeline stop_timeline synchronize""",
    "horovod.torch.mpi_ops": """
        Adasum Average Compression HorovodAllgather HorovodAllreduce HorovodAlltoall
        HorovodBroadcast HorovodGroupedAllgather HorovodGroupedAllreduce
        HorovodGroupedReducescatter HorovodInternalError HorovodReducescatter Max Min
        ProcessSet Product Sum add_process_set allgather allgather_async allreduce
        allreduce_ allreduce_async allreduce_async_ alltoall alltoall_async barrier
        broadcast broadcast_ broadcast_async broadcast_async_ ccl_built
        check_installed_version cross_rank cross_size cuda_built ddl_built
        get_average_backwards_compatibility_fun global_process_set gloo_built
        gloo_enabled gpu_available grouped_allgather grouped_allgather_async
        grouped_allreduce grouped_allreduce_ grouped_allreduce_async
        grouped_allreduce_async_ grouped_reducescatter grouped_reducescatter_async
        handle_average_backwards_compatibility init is_homogeneous is_initialized join
        local_rank local_size mpi_built mpi_enabled mpi_threads_supported nccl_built
        num_rank_is_power_2 poll rank reducescatter reducescatter_async
        remove_process_set rocm_built shutdown size sparse_allreduce_async
        start_timeline stop_timeline synchronize""",
    "horovod.torch.elastic": "ElasticSampler TorchState init run run_fn shutdown",
    "horovod.torch.elastic.state": """
        ElasticSampler ModelStateHandler ObjectState OptimizerStateHandler
        SamplerStateHandler StateHandler TorchState allgather_object broadcast_object
        broadcast_optimizer_state broadcast_parameters get_handler_registry rank
        set_handler_registry""",
    "horovod.torch.elastic.sampler": "ElasticSampler rank size",
    "horovod.common": "",
    "horovod.common.basics": "HorovodBasics MPI ProcessSet global_process_set util",
    "horovod.common.elastic": """
        HorovodInternalError HostUpdateResult HostsUpdatedInterrupt ObjectState State
        WorkerNotificationManager notification_manager run_fn""",
    "horovod.common.exceptions": """
        HorovodInternalError HorovodVersionMismatchError HostsUpdatedInterrupt
        get_version_mismatch_message""",
    "horovod.common.process_sets": """
        HorovodBasics MPI ProcessSet add_process_set global_process_set is_iterable
        remove_process_set""",
    "horovod.common.util": """
        EXTENSIONS HorovodVersionMismatchError ccl_built check_extension
        check_installed_version ddl_built env extension_available
        get_average_backwards_compatibility_fun get_ext_suffix get_extension_full_path
        get_version_mismatch_message gloo_built gpu_available is_iterable
        is_version_greater_equal_than mpi_built nccl_built num_rank_is_power_2
        split_list""",
}
# Left out on purpose: horovod.torch.mpi_ops.mpi_lib, Horovod's compiled library
# module, whose functions are Horovod's C ABI (horovod_torch's extension is
# horovod_torch._C, with another interface).


@pytest.fixture
def world_of_one():
    with pytest.MonkeyPatch.context() as mp:
        for v in LAUNCHER_VARS:
            mp.delenv(v, raising=False)
        hvd.init()
        try:
            yield
        finally:
            hvd.shutdown()


@pytest.mark.parametrize("module", sorted(UPSTREAM_NAMES))
def test_every_upstream_public_name_resolves(module):
    mod = importlib.import_module(module)
    missing = [n for n in UPSTREAM_NAMES[module].split() if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


def test_the_same_objects_under_every_name():
    from horovod.common import basics as cb, elastic as ce, exceptions as cx
    from horovod.common import process_sets as cp, util as cu
    from horovod.torch import mpi_ops
    from horovod.torch.elastic import state as es
    assert cp.ProcessSet is hvd.ProcessSet and cb.ProcessSet is hvd.ProcessSet
    assert cp.global_process_set is hvd.global_process_set is cb.global_process_set
    assert cp.add_process_set is hvd.add_process_set
    assert cp.remove_process_set is hvd.remove_process_set
    assert ce.State is hvd.elastic.State and ce.ObjectState is hvd.elastic.ObjectState
    assert es.TorchState is hvd.elastic.TorchState and es.ElasticSampler is hvd.elastic.ElasticSampler
    assert ce.HorovodInternalError is cx.HorovodInternalError is hvd.HorovodInternalError
    assert ce.HostsUpdatedInterrupt is cx.HostsUpdatedInterrupt is hvd.HostsUpdatedInterrupt
    assert issubclass(cx.HorovodVersionMismatchError, ImportError)
    assert cu.HorovodVersionMismatchError is cx.HorovodVersionMismatchError
    assert mpi_ops.HorovodInternalError is hvd.HorovodInternalError
    for name in ("cross_rank", "cross_size", "is_homogeneous", "allreduce", "rank",
                 "grouped_allreduce", "Compression"):
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
    assert hvd.elastic.run_fn is ce.run_fn
    assert cb.util is cu
    assert isinstance(horovod.__version__, str) and horovod.__version__.count(".") == 2


def test_version_mismatch_error_message_names_both_versions():
    from horovod.common.exceptions import HorovodVersionMismatchError
    e = HorovodVersionMismatchError("pytorch", "2.9.0", "2.1.0")
    assert (e.name, e.version, e.installed_version) == ("pytorch", "2.9.0", "2.1.0")
    assert "2.9.0" in str(e) and "2.1.0" in str(e)


# ------------------------------------------------------------------ horovod.common.util

def test_util_average_backwards_compatibility():
    from horovod.torch.mpi_ops import handle_average_backwards_compatibility as resolve
    assert resolve(None, None) == hvd.Average
    assert resolve(hvd.Max, None) == hvd.Max
    with pytest.warns(DeprecationWarning):
        assert resolve(None, True) == hvd.Average
    with pytest.warns(DeprecationWarning):
        assert resolve(None, False) == hvd.Sum
    with pytest.raises(ValueError):
        resolve(hvd.Sum, True)


def test_util_small_helpers():
    from horovod.common import util
    assert [n for n in range(20) if util.num_rank_is_power_2(n)] == [1, 2, 4, 8, 16]
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert util.split_list([], 2) == [[], []]
    assert [len(c) for c in util.split_list(list(range(10)), 4)] == [3, 3, 2, 2]
    assert util.is_iterable([1]) and util.is_iterable("x") and not util.is_iterable(3)
    assert util.is_version_greater_equal_than("2.1.0", "2.0.5")
    assert not util.is_version_greater_equal_than("1.9", "2.0.0")
    with pytest.raises(ValueError):
        util.is_version_greater_equal_than("1.0.0", "1.0")
    with pytest.raises(ValueError):
        util.is_version_greater_equal_than(1, "1.0.0")
    assert util.EXTENSIONS == ["tensorflow", "torch", "mxnet"]
    assert util.get_ext_suffix().endswith(".so")
    assert util.get_extension_full_path("/a/b/__init__.py", "c", "lib") == \
        "/a/b/c/lib" + util.get_ext_suffix()


def test_util_env_sets_and_restores(monkeypatch):
    from horovod.common.util import env
    monkeypatch.setenv("HVD_COMPAT_A", "old")
    monkeypatch.delenv("HVD_COMPAT_B", raising=False)
    with env(HVD_COMPAT_A="new", HVD_COMPAT_B="b", HVD_COMPAT_C=None):
        assert os.environ["HVD_COMPAT_A"] == "new" and os.environ["HVD_COMPAT_B"] == "b"
        assert "HVD_COMPAT_C" not in os.environ
    assert os.environ["HVD_COMPAT_A"] == "old" and "HVD_COMPAT_B" not in os.environ


def test_util_build_probes_and_extension_checks():
    from horovod.common import util
    assert util.extension_available("torch") is True
    assert util.extension_available("tensorflow") is False
    assert util.extension_available("mxnet") is False
    assert util.gpu_available("tensorflow") is False
    assert util.gpu_available("torch") == torch.cuda.is_available()
    assert util.gloo_built() is True
    assert util.mpi_built() == hvd.mpi_built() and util.nccl_built() == hvd.nccl_built()
    assert util.ddl_built() is False and util.ccl_built() is False
    # Horovod's own call from horovod/torch/__init__.py names its library; the
    # PyTorch extension here is horovod_torch._C.
    util.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", hvd.__file__, "mpi_lib_v2")
    hvd.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", hvd.__file__, "mpi_lib_v2")
    with pytest.raises(ImportError):
        util.check_extension("horovod.tensorflow", "HOROVOD_WITH_TENSORFLOW",
                             hvd.__file__, "mpi_lib")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        util.check_installed_version("pytorch", torch.__version__)  # no warning
    with pytest.warns(UserWarning, match="0.0.1"):
        util.check_installed_version("pytorch", "0.0.1")
    with pytest.raises(util.HorovodVersionMismatchError):
        util.check_installed_version("pytorch", "0.0.1", RuntimeError("undefined symbol"))


# ------------------------------------------------------------------ horovod.common.basics

def test_horovod_basics_object(world_of_one):
    from horovod.common.basics import HorovodBasics
    b = HorovodBasics(hvd.__file__, "mpi_lib_v2")
    assert (b.Average, b.Sum, b.Adasum, b.Min, b.Max, b.Product) == (0, 1, 2, 3, 4, 5)
    assert b.is_initialized()
    assert (b.rank(), b.size(), b.local_rank(), b.local_size()) == (0, 1, 0, 1)
    assert (b.cross_rank(), b.cross_size(), b.is_homogeneous()) == (0, 1, True)
    assert b.gloo_built() is True and b.nccl_built() == hvd.nccl_built()
    assert b.mpi_built() == hvd.mpi_built() and b.cuda_built() == hvd.cuda_built()
    assert b.rocm_built() is False and b.ddl_built() is False and b.ccl_built() is False
    assert b.mpi_enabled() is False and b.gloo_enabled() is True
    b.shutdown()
    assert not hvd.is_initialized()
    b.init()
    assert hvd.is_initialized() and hvd.size() == 1


def test_mpi_ops_topology(world_of_one):
    from horovod.torch import mpi_ops
    assert (mpi_ops.cross_rank(), mpi_ops.cross_size(), mpi_ops.is_homogeneous()) == (0, 1, True)
    assert mpi_ops.num_rank_is_power_2(mpi_ops.size())
