"""Loads the C++ extension, horovod_torch._C, or says in one message why it cannot.

The extension links against libtorch's C++ symbols, so it only loads into the torch it
was compiled against (setup.py records that version in horovod_torch/_build_info.py).
A different torch gives an ImportError naming both versions and the command that
rebuilds, instead of an undefined-symbol trace or a crash.
"""
import torch

REBUILD = ("rebuild it against the torch you run: `pip install --no-build-isolation "
           "--force-reinstall --no-deps <horovod_torch source>` (or `make build` in a "
           "checkout)")


def check_torch_version(built: str, running: str) -> None:
    """Raises ImportError when the extension was built for another torch."""
    if built != running:
        raise ImportError(
            f"horovod_torch's C++ extension was built against torch {built}, but torch "
            f"{running} is imported; {REBUILD}")


def load():
    """Imports and returns horovod_torch._C after the version check."""
    try:
        from horovod_torch import _build_info
    except ImportError:
        _build_info = None  # built by an older setup.py: nothing to compare
    if _build_info is not None:
        check_torch_version(_build_info.TORCH_VERSION, torch.__version__)
    try:
        from horovod_torch import _C
    except ImportError as e:
        if "No module named" in str(e):
            raise ImportError(
                "horovod_torch's C++ extension (horovod_torch._C) is not built: run "
                "`pip install .` in the source tree, or `make build` in a checkout") from e
        raise ImportError(
            f"horovod_torch's C++ extension does not load into torch {torch.__version__} "
            f"({e}); {REBUILD}") from e
    return _C


_C = load()
