"""``horovod.common.exceptions``: Horovod's exception types, which are horovod_torch's."""
from horovod_torch.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
