"""``horovod.common.exceptions``: Horovod's exception types, which are horovod_torch's."""
from horovod_torch.common.exceptions import (HorovodInternalError,  # noqa: F401
                                             HorovodVersionMismatchError, HostsUpdatedInterrupt,
                                             get_version_mismatch_message)
