"""Optional dependencies and the extras that install them (pyproject.toml's
``[project.optional-dependencies]``; ``pip install 'horovod_torch[all]'`` installs every
one). A feature that needs one imports it through :func:`require`, so that a missing
package is an ImportError naming the extra, not a bare ModuleNotFoundError.

Torch-free and ``_C``-free: the runner imports it."""
import importlib
import importlib.util
from types import ModuleType

# module -> (the distribution that provides it, the extra that installs it)
PROVIDERS = {
    "yaml": ("pyyaml", "config"),
    "matplotlib": ("matplotlib", "timeline"),
    "sklearn": ("scikit-learn", "examples"),
    "pyspark": ("pyspark", "spark"),
    "ray": ("ray", "ray"),
    "lightning": ("lightning", "lightning"),
}


def missing_message(module: str, feature: str) -> str:
    dist, extra = PROVIDERS[module]
    return (f"{feature} needs the {dist} package, which is not installed: "
            f"pip install 'horovod_torch[{extra}]' (or pip install {dist})")


def require(module: str, feature: str) -> ModuleType:
    """Imports `module` (a name in PROVIDERS, or a submodule of one) for `feature`, or
    raises ImportError saying which extra installs it."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if importlib.util.find_spec(top) is not None:
            raise  # installed, but broken, or something it imports is missing
        raise ImportError(missing_message(top, feature), name=top) from exc
