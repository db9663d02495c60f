"""``horovod.common.util``: Horovod's helpers (build probes, extension checks, ``env``,
the ``average=`` / ``op=`` rule, ...), answered by horovod_torch.util."""
from horovod_torch.common.util import *  # noqa: F401,F403
from horovod_torch.common.util import __all__  # noqa: F401
