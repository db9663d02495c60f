"""``horovod.common.process_sets``: Horovod's process sets, which are horovod_torch's
(``hvd.ProcessSet``, ``hvd.add_process_set``, ...)."""
from horovod.common.basics import MPI, HorovodBasics  # noqa: F401
from horovod_torch.collectives.process_sets import (ProcessSet, add_process_set,  # noqa: F401
                                                    global_process_set, remove_process_set)
from horovod_torch.common.util import is_iterable  # noqa: F401

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
