"""``horovod.common.elastic``: Horovod's framework-independent elastic classes, which
are horovod_torch's (``State``, ``ObjectState``, ``run_fn``, ...)."""
from horovod_torch.training.elastic import run_fn  # noqa: F401
from horovod_torch.training.elastic.state import ObjectState, State  # noqa: F401
from horovod_torch.common.elastic_worker import (HostUpdateResult,  # noqa: F401
                                                 WorkerNotificationManager, notification_manager)
from horovod_torch.common.exceptions import (HorovodInternalError,  # noqa: F401
                                             HostsUpdatedInterrupt)
