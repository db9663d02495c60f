"""``horovod.common.elastic``: Horovod's framework-independent elastic classes, which
are horovod_torch's (``State``, ``ObjectState``, ``run_fn``, ...)."""
from horovod_torch.elastic import run_fn  # noqa: F401
from horovod_torch.elastic.state import ObjectState, State  # noqa: F401
from horovod_torch.elastic.worker import (HostUpdateResult,  # noqa: F401
                                          WorkerNotificationManager, notification_manager)
from horovod_torch.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
