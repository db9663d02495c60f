"""Compatibility namespace: ``import horovod.torch as hvd`` gives horovod_torch."""
