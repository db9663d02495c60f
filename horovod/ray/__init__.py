"""``horovod.ray`` is horovod_torch.ray: the same module object, so
``from horovod.ray import RayExecutor, ElasticRayExecutor`` and submodules such as
``horovod.ray.ray_logger`` and ``horovod.ray.elastic`` work unchanged."""
import sys

import horovod_torch.ray

for _name, _mod in list(sys.modules.items()):
    if _name.startswith("horovod_torch.ray."):
        sys.modules["horovod.ray." + _name[len("horovod_torch.ray."):]] = _mod
sys.modules[__name__] = horovod_torch.ray
