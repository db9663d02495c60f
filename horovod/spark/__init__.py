"""``horovod.spark`` is horovod_torch.spark (horovod_torch/integrations/spark): the same
module object, so ``horovod.spark.run(fn, ...)`` works unchanged (``run_elastic`` says it is not
supported; Horovod's Spark estimators are not provided, see docs/integrations.md)."""
import sys

import horovod_torch.integrations.spark as _module

# The names below horovod.spark are resolved by horovod_torch's alias finder
# (horovod_torch/_aliases.py), which importing horovod_torch installed.
sys.modules[__name__] = _module
