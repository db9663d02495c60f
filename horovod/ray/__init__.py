"""``horovod.ray`` is horovod_torch.ray (horovod_torch/integrations/ray): the same module object, so
``from horovod.ray import RayExecutor, ElasticRayExecutor`` and submodules such as
``horovod.ray.ray_logger`` and ``horovod.ray.elastic`` work unchanged."""
import sys

import horovod_torch.integrations.ray as _module

# The names below horovod.ray are resolved by horovod_torch's alias finder
# (horovod_torch/_aliases.py), which importing horovod_torch installed.
sys.modules[__name__] = _module
