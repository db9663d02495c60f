"""horovod_torch on Ray (Horovod's ``horovod.ray``): ``RayExecutor`` runs a job whose
workers are Ray actors; ``ElasticRayExecutor`` (or ``RayExecutor(min_workers=...)``)
an elastic one, with Ray's nodes as the hosts. ``from horovod.ray import RayExecutor``
gives these. See docs/integrations.md."""
from horovod_torch.common import extras

extras.require("ray", "horovod_torch.ray")

from horovod_torch.integrations.ray.worker import BaseHorovodWorker  # noqa: E402
from horovod_torch.integrations.ray.runner import RayExecutor  # noqa: E402
from horovod_torch.integrations.ray.elastic import (ElasticRayExecutor,  # noqa: E402
                                                    RayHostDiscovery)
from horovod_torch.integrations.ray import ray_logger  # noqa: E402

__all__ = ["RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor", "RayHostDiscovery",
           "ray_logger"]
