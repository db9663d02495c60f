"""horovod_torch: distributed data-parallel training for PyTorch with Horovod's API.

Scripts written for Horovod run unchanged: ``import horovod.torch as hvd`` resolves
to this package.

The API (horovod_torch/_api.py) loads torch and the C++ extension, so it is loaded on
the first use of one of its names, not by ``import horovod_torch``: the launcher
(``horovodrun``, horovod_torch.runner) is a subpackage and starts without either.

The modules sit in folders named after their layer (docs/design.md §1); the paths they
had before (``horovod_torch.ops``, ``horovod_torch.elastic``) and Horovod's
(``horovod.torch.mpi_ops``) name the same modules (horovod_torch/_aliases.py).
"""
import importlib
import importlib.util
import sys

from horovod_torch import _aliases

_aliases.install()

__version__ = "0.1.0"


def _load_api():
    """Imports the API and makes its names this package's own attributes."""
    _api = importlib.import_module(f"{__name__}._api")
    namespace = globals()
    for name in _api.__all__:
        namespace.setdefault(name, getattr(_api, name))
    return _api


def __getattr__(name):
    if name == "__all__":
        return list(_load_api().__all__)
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "_C":  # the extension, after the torch version check (engine/extension.py)
        return importlib.import_module(f"{__name__}.engine.extension")._C
    # A submodule (``from horovod_torch import config``, ``hvd.elastic``) is imported
    # on its own, without the rest of the API.
    submodule = f"{__name__}.{name}"
    if submodule in sys.modules or importlib.util.find_spec(submodule) is not None:
        return importlib.import_module(submodule)
    api = _load_api()
    if name in api.__all__:
        return globals()[name]
    raise AttributeError(f"module 'horovod_torch' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_load_api().__all__))
