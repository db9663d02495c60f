"""Loads the C++ extension, horovod_torch._C, or says in one message why it cannot.

The extension links against libtorch's C++ symbols, so it only loads into the torch it
was compiled against (setup.py records that version in horovod_torch/_build_info.py).
A different torch gives an ImportError naming both versions and the command that
rebuilds, instead of an undefined-symbol trace or a crash.
"""
import glob
import os
import sys

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


def shadowed_builds(package_dir: str) -> list:
    """Built horovod_torch packages in other folders of sys.path: installed ones that the
    unbuilt package at `package_dir` (a source tree first on the path) hides."""
    here = os.path.realpath(os.path.dirname(package_dir))
    found = []
    for entry in sys.path:
        folder = os.path.realpath(entry or os.getcwd())
        other = os.path.join(folder, "horovod_torch")
        if folder != here and other not in found and glob.glob(os.path.join(other, "_C*.so")):
            found.append(other)
    return found


def not_built_message(package_dir: str) -> str:
    hidden = shadowed_builds(package_dir)
    if hidden:
        return (f"horovod_torch was imported from {package_dir}, a source tree whose C++ "
                f"extension is not built, and it hides the built horovod_torch at "
                f"{hidden[0]}: run from another directory or take the tree off PYTHONPATH "
                "(or sys.path), or build the tree in place (`make build`)")
    return ("horovod_torch's C++ extension (horovod_torch._C) is not built: run "
            "`pip install .` in the source tree, or `make build` in a checkout")


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
        # A missing module reads "No module named ..." or, from a package's folder,
        # "cannot import name '_C' from 'horovod_torch'".
        if "No module named" in str(e) or "cannot import name '_C'" in str(e):
            package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            raise ImportError(not_built_message(package_dir)) from e
        raise ImportError(
            f"horovod_torch's C++ extension does not load into torch {torch.__version__} "
            f"({e}); {REBUILD}") from e
    return _C


_C = load()
