"""``horovod.runner`` for scripts written against Horovod: ``run`` (also ``horovod.run``),
``python -m horovod.runner.launch`` and ``horovod.runner.util.threads``. The code is in
``horovod_torch.runner``."""
from horovod_torch.runner.func import run  # noqa: F401
