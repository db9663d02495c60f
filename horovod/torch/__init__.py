"""``horovod.torch`` is horovod_torch: the same module object, so attributes, state and
submodules (``horovod.torch.elastic``) are shared."""
import sys

import horovod_torch

horovod_torch._load_api()  # pylint: disable=protected-access  (the submodules it loads)

for _name, _mod in list(sys.modules.items()):
    if _name.startswith("horovod_torch."):
        sys.modules["horovod.torch." + _name[len("horovod_torch."):]] = _mod
sys.modules[__name__] = horovod_torch
