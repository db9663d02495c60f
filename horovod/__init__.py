"""Compatibility namespace: ``import horovod.torch as hvd`` gives horovod_torch;
``horovod.run`` is ``horovod.runner.run``."""


def _warn_if_upstream_is_installed_too() -> None:
    """Upstream Horovod's distribution (``horovod``) and ours both install a top-level
    ``horovod`` package: installed into one environment, one overwrites the other's
    files and leaves its own, a mix that neither project tested. Say so once, at
    import (pip offers no hook at install time)."""
    import warnings
    from importlib import metadata
    try:
        upstream = metadata.distribution("horovod")
    except metadata.PackageNotFoundError:
        return
    warnings.warn(
        f"upstream Horovod {upstream.version} is installed in this environment as well as "
        f"horovod_torch, and both provide the 'horovod' package ({__path__[0]}): its files "
        "are now a mix of the two. Keep them in separate environments, or run `pip "
        "uninstall -y horovod horovod_torch` and reinstall the one you want.",
        RuntimeWarning, stacklevel=2)


_warn_if_upstream_is_installed_too()


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
