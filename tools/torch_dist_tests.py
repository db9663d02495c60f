"""PyTorch's own torch.distributed tests (torch/testing/_internal/distributed/
distributed_test.py, shipped with torch; what torch's test/distributed/
test_distributed_spawn.py runs) against a backend named by $BACKEND: "hvd" (this
package) or "gloo" (the reference). Nothing of torch's is copied: this module only
binds its test class to spawned processes, as test_distributed_spawn.py does.

    BACKEND=hvd WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) python -m pytest tools/torch_dist_tests.py \\
        -k 'test_all_reduce or test_broadcast' --junitxml=hvd.xml

tools/torch_dist_tests.sh runs a set on both backends and compares them.
"""
import os

import torch.distributed as dist

import horovod_torch.torch_distributed  # noqa: F401  (registers "hvd"; spawned ranks import this too)

if not os.environ.get("BACKEND"):
    raise SystemExit("set BACKEND (hvd or gloo), WORLD_SIZE and TEMP_DIR")

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)

# "hvd" in torch's feature table, as a plugin backend (torch's own hook for them), with
# what it implements (docs/torch_distributed.md): CPU and CUDA tensors, DDP; no subgroups.
for feature in ("plugin", "gpu", "cuda", "ddp"):
    DistTestCases.backend_feature[feature].add("hvd")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


assert dist.is_available()
