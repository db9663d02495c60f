"""The public API, loaded on first use by horovod_torch/__init__.py (which says why)."""
import torch  # noqa: F401  (loads libtorch before the extension)
from horovod_torch.engine import extension as _ext  # noqa: F401  (loads _C, or says why not)

from horovod_torch.engine.basics import (Adasum, Average, Max, Min, Product, Sum, ccl_built,
                                         cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                                         gloo_enabled, init, is_homogeneous, is_initialized,
                                         local_rank, local_size, mpi_built, mpi_enabled,
                                         mpi_threads_supported, nccl_built, rank, rocm_built,
                                         shutdown, size, start_timeline, stop_timeline,
                                         straggler_report)
from horovod_torch.collectives.compression import Compression
from horovod_torch.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod_torch.training.functions import (allgather_object, broadcast_object,
                                              broadcast_optimizer_state, broadcast_parameters)
from horovod_torch.training.optimizer import DistributedOptimizer
from horovod_torch.collectives.sparse import sparse_allreduce_async
from horovod_torch.training.sync_batch_norm import SyncBatchNorm
from horovod_torch.common.util import check_extension
from horovod_torch.collectives.ops import (ProcessSet, allgather, allgather_async, allreduce,
                                           allreduce_, allreduce_async, allreduce_async_, alltoall,
                                           alltoall_async, barrier, broadcast, broadcast_,
                                           broadcast_async, broadcast_async_, global_process_set,
                                           grouped_allgather, grouped_allgather_async,
                                           grouped_allreduce, grouped_allreduce_,
                                           grouped_allreduce_async, grouped_allreduce_async_,
                                           grouped_reducescatter, grouped_reducescatter_async, poll,
                                           join, reducescatter, reducescatter_async, synchronize,
                                           add_process_set, remove_process_set)

from horovod_torch.training import elastic  # noqa: E402  (after the names it uses)
# (this import registers the torch.distributed backend "hvd")
from horovod_torch.integrations import torch_distributed  # noqa: E402,F401

__all__ = [n for n in dir() if not n.startswith("_") and n != "torch"]
