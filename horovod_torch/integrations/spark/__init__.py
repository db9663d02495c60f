"""horovod_torch on Apache Spark (Horovod's ``horovod.spark.run``).

``horovod_torch.spark.run(fn, args, kwargs, num_proc=...)`` runs ``fn`` in ``num_proc``
Spark tasks of one barrier stage, one horovod_torch rank each, and returns the values
in rank order. The driver runs the rendezvous store, with a fresh random secret per
job, as ``horovodrun`` does; ``hvd.init()`` in ``fn`` joins the job unchanged
(docs/integrations.md).

pyspark is imported when ``run`` is called, not with this package.
"""
from horovod_torch.integrations.spark.runner import run, run_elastic

__all__ = ["run", "run_elastic"]
