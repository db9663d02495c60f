"""Compatibility namespace: ``import horovod.torch as hvd`` gives horovod_torch;
``horovod.run`` is ``horovod.runner.run``."""


def __getattr__(name):
    # Looked up on first use, so that ``import horovod.common`` loads nothing more.
    if name == "run":
        from horovod_torch.runner.func import run  # pylint: disable=import-outside-toplevel
        return run
    if name == "__version__":
        # The Horovod API this package implements (docs/compat.md), for scripts that
        # check it; horovod_torch.__version__ is this package's own version.
        return "0.28.1"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
