"""``horovod.runner.util.threads``: ``in_thread`` and ``on_event`` of
``horovod_torch.runner.util.threads``."""
from horovod_torch.runner.util.threads import in_thread, on_event  # noqa: F401
