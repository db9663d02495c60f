"""``horovod.spark`` is horovod_torch.spark: the same module object, so
``horovod.spark.run(fn, ...)`` works unchanged (``run_elastic`` says it is not
supported; Horovod's Spark estimators are not provided, see docs/integrations.md)."""
import sys

import horovod_torch.spark

for _name, _mod in list(sys.modules.items()):
    if _name.startswith("horovod_torch.spark."):
        sys.modules["horovod.spark." + _name[len("horovod_torch.spark."):]] = _mod
sys.modules[__name__] = horovod_torch.spark
