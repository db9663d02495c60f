"""``horovod.torch`` is horovod_torch: the same module object, so attributes, state and
submodules (``horovod.torch.elastic``, ``horovod.torch.mpi_ops``) are shared; the names
below horovod.torch are resolved by horovod_torch's alias finder
(horovod_torch/_aliases.py)."""
import sys

import horovod_torch

# As ``import horovod.torch`` always did: the API is loaded here, not on first use.
horovod_torch._load_api()  # pylint: disable=protected-access
sys.modules[__name__] = horovod_torch
