"""``horovod.torch.mpi_ops``: the module Horovod's collectives live in. Code that
imports them from here gets horovod_torch's."""
from horovod_torch.engine import basics as _basics
from horovod_torch.engine.basics import (Adasum, Average, Max, Min, Product, Sum,  # noqa: F401
                                         ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                                         gloo_built, gloo_enabled, init, is_homogeneous,
                                         is_initialized, local_rank, local_size, mpi_built,
                                         mpi_enabled, mpi_threads_supported, nccl_built, rank,
                                         rocm_built, shutdown, size, start_timeline, stop_timeline)
from horovod_torch.collectives.compression import Compression  # noqa: F401
from horovod_torch.common.exceptions import HorovodInternalError  # noqa: F401
from horovod_torch.collectives.ops import *  # noqa: F401,F403
from horovod_torch.collectives.ops import (GroupHandle, ProcessSet, add_process_set,  # noqa: F401
                                           global_process_set, join, poll, remove_process_set,
                                           synchronize)
from horovod_torch.collectives.sparse import sparse_allreduce_async  # noqa: F401
from horovod_torch.common.util import (check_installed_version,  # noqa: F401
                                       get_average_backwards_compatibility_fun, gpu_available,
                                       num_rank_is_power_2)

# fn(op, average) -> the reduction op, with Horovod's rule for the deprecated `average`.
handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_basics)
