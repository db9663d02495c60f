"""The import paths that name a module by its old place or by Horovod's name.

horovod_torch's modules sit in folders named after their layer (docs/design.md §1):
common/, runner/, engine/, collectives/, training/ and integrations/. Scripts import
them by the paths they always had (``horovod_torch.ops``, ``horovod_torch.elastic``,
``horovod_torch.ray``) or by Horovod's (``horovod.torch.mpi_ops``,
``horovod.ray.elastic``). A finder first on ``sys.meta_path`` resolves each such path
to the module at its place: the same module object, imported when first asked for (so
``horovod_torch.ray`` still loads Ray only then), so that attributes, patches and
pickled references agree. ``python -m`` runs an aliased module too.

Torch-free; code inside the package imports the real paths (tools/check_layers.py).
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# Where each module moved when the package was sorted into layer folders (a package's
# submodules move with it; the longest matching name wins).
MOVED = {
    "exceptions": "common.exceptions", "config": "common.config", "util": "common.util",
    "timeline": "common.timeline", "build_vars": "common.build_vars",
    "elastic_keys": "common.elastic_keys", "handle": "common.handle",
    "launch_env": "common.launch_env", "extras": "common.extras", "data": "common.data",
    "elastic.worker": "common.elastic_worker",
    "_ext": "engine.extension", "rendezvous": "engine.rendezvous", "basics": "engine.basics",
    "compression": "collectives.compression", "adasum": "collectives.adasum",
    "submit": "collectives.submit", "process_sets": "collectives.process_sets",
    "ops": "collectives.ops", "sparse": "collectives.sparse",
    "mpi_ops": "collectives.mpi_ops",
    "optimizer": "training.optimizer", "sharded": "training.sharded",
    "sharded_recovery": "training.sharded_recovery", "functions": "training.functions",
    "sync_batch_norm": "training.sync_batch_norm", "elastic": "training.elastic",
    "ray": "integrations.ray", "spark": "integrations.spark",
    "lightning": "integrations.lightning", "torch_distributed": "integrations.torch_distributed",
}
# Horovod's packages and the modules that answer for them; their own names are real
# packages (horovod/torch/__init__.py, ...), the names below them are aliases.
HOROVOD = {
    "horovod.torch": "horovod_torch",
    "horovod.ray": "horovod_torch.integrations.ray",
    "horovod.spark": "horovod_torch.integrations.spark",
}
PACKAGE = "horovod_torch"


def _replace_prefix(name: str, table: dict, strict: bool) -> str:
    """`name` with its longest prefix listed in `table` replaced (`strict`: only names
    below a listed one, not the listed name itself)."""
    best = None
    for old in table:
        if name.startswith(old + ".") or (not strict and name == old):
            if best is None or len(old) > len(best):
                best = old
    return name if best is None else table[best] + name[len(best):]


def target(name: str) -> str:
    """The real name of module `name` (itself when it is not an alias)."""
    name = _replace_prefix(name, HOROVOD, strict=True)
    if name.startswith(PACKAGE + "."):
        rest = _replace_prefix(name[len(PACKAGE) + 1:], MOVED, strict=False)
        name = f"{PACKAGE}.{rest}"
    return name


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the module it names."""

    def __init__(self, real: str):
        self.real = real
        self._spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.real)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import system set the alias's spec on the module; give it back its own.
        module.__spec__ = self._spec

    def get_code(self, fullname):  # what `python -m <alias>` runs
        return importlib.util.find_spec(self.real).loader.get_code(self.real)


class AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target_module=None):
        real = target(fullname)
        if real == fullname:
            return None
        found = importlib.util.find_spec(real)  # imports the real module's parents only
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), origin=found.origin)


def install() -> None:
    """Puts the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
