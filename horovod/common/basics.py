"""``horovod.common.basics``: Horovod's ``HorovodBasics`` (init, shutdown, topology,
build probes, reduction ops), answered by horovod_torch's engine.

Horovod builds one such object per framework extension from the path of its library
(``HorovodBasics(__file__, 'mpi_lib_v2')``); horovod_torch has one engine, so the
arguments are accepted and ignored, and every instance shares horovod_torch's state."""
from typing import Optional, Sequence

from horovod.common import util  # noqa: F401
from horovod_torch.engine import basics as _basics
from horovod_torch.collectives.process_sets import ProcessSet, global_process_set  # noqa: F401


class MPI:
    """Stands for mpi4py's ``MPI`` in type annotations (importing mpi4py starts MPI)."""

    class Comm:
        ...


class HorovodBasics:
    """The basic Horovod API as an object: ``b = HorovodBasics(__file__); b.init();
    b.rank()`` ... Reduction ops are attributes (``b.Average``, ``b.Sum``, ...)."""

    Average = _basics.Average
    Sum = _basics.Sum
    Adasum = _basics.Adasum
    Min = _basics.Min
    Max = _basics.Max
    Product = _basics.Product

    # Horovod's process-set error codes (operations.cc), for code that compares them.
    HOROVOD_PROCESS_SET_ERROR_INIT = -1
    HOROVOD_PROCESS_SET_ERROR_DYNAMIC = -2
    HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET = -3
    HOROVOD_PROCESS_SET_ERROR_FOREIGN_SET = -4
    HOROVOD_PROCESS_SET_ERROR_SHUTDOWN = -5
    HOROVOD_PROCESS_SET_ERROR_EXISTING_SET = -6

    def __init__(self, pkg_path: Optional[str] = None, *args: str):
        self.pkg_path = pkg_path

    def init(self, comm=None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
        """hvd.init(comm, process_sets)."""
        _basics.init(comm=comm, process_sets=process_sets)

    def shutdown(self) -> None:
        _basics.shutdown()

    def is_initialized(self) -> bool:
        return _basics.is_initialized()

    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        _basics.start_timeline(file_path, mark_cycles)

    def stop_timeline(self) -> None:
        _basics.stop_timeline()

    def size(self) -> int:
        return _basics.size()

    def local_size(self) -> int:
        return _basics.local_size()

    def cross_size(self) -> int:
        return _basics.cross_size()

    def rank(self) -> int:
        return _basics.rank()

    def local_rank(self) -> int:
        return _basics.local_rank()

    def cross_rank(self) -> int:
        return _basics.cross_rank()

    def is_homogeneous(self) -> bool:
        return _basics.is_homogeneous()

    def mpi_threads_supported(self) -> bool:
        return _basics.mpi_threads_supported()

    def mpi_enabled(self) -> bool:
        return _basics.mpi_enabled()

    def mpi_built(self) -> bool:
        return _basics.mpi_built()

    def gloo_enabled(self) -> bool:
        return _basics.gloo_enabled()

    def gloo_built(self) -> bool:
        return _basics.gloo_built()

    def nccl_built(self) -> int:
        return _basics.nccl_built()

    def ddl_built(self) -> bool:
        return _basics.ddl_built()

    def ccl_built(self) -> bool:
        return _basics.ccl_built()

    def cuda_built(self) -> bool:
        return _basics.cuda_built()

    def rocm_built(self) -> bool:
        return _basics.rocm_built()
