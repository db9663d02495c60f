"""Lightning 2.x on horovod_torch: ``lightning.Trainer(strategy=HorovodStrategy())``
(or ``strategy="horovod"`` after importing this package), in a job started by
``horovodrun`` or any launcher ``hvd.init()`` understands (docs/integrations.md).

Works with the ``lightning`` package (``lightning.pytorch``), else with the standalone
``pytorch_lightning``.
"""
from horovod_torch.integrations.lightning.strategy import HorovodEnvironment, HorovodStrategy

__all__ = ["HorovodEnvironment", "HorovodStrategy"]
