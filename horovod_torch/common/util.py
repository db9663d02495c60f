"""Helpers Horovod keeps in ``horovod.common.util`` (build probes, extension checks,
the ``average=`` / ``op=`` compatibility rule, ...), answered by horovod_torch.

Horovod probes each framework's extension in a forked subprocess; horovod_torch has a
single extension (PyTorch's, ``horovod_torch._C``), which these functions load in
this process. TensorFlow and MXNet extensions are never available here."""
import contextlib
import importlib
import os
import sysconfig
import warnings
from typing import Any, Callable, Iterator, List, Optional, Sequence

from horovod_torch.common.exceptions import (HorovodVersionMismatchError,
                                             get_version_mismatch_message)

EXTENSIONS = ["tensorflow", "torch", "mxnet"]
_TORCH_NAMES = ("torch", "pytorch", "horovod.torch", "horovod_torch")

__all__ = ["EXTENSIONS", "HorovodVersionMismatchError", "ccl_built", "check_extension",
           "check_installed_version", "ddl_built", "env", "extension_available",
           "get_average_backwards_compatibility_fun", "get_ext_suffix",
           "get_extension_full_path", "get_version_mismatch_message", "gloo_built",
           "gpu_available", "is_iterable", "is_version_greater_equal_than", "mpi_built",
           "nccl_built", "num_rank_is_power_2", "split_list"]


def get_ext_suffix() -> str:
    """The file suffix of a compiled Python extension here (e.g. ``.cpython-311-...so``)."""
    return sysconfig.get_config_var("EXT_SUFFIX") or sysconfig.get_config_var("SO") or ".so"


def get_extension_full_path(pkg_path: str, *args: str) -> str:
    """The path of extension ``args[-1]`` in the folder of `pkg_path` (joined with the
    folders ``args[:-1]``)."""
    if not args:
        raise ValueError("get_extension_full_path needs the extension's name")
    folder = os.path.join(os.path.dirname(pkg_path), *args[:-1])
    return os.path.join(folder, args[-1] + get_ext_suffix())


def _torch_extension_path() -> str:
    import horovod_torch
    return get_extension_full_path(horovod_torch.__file__, "_C")


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: str) -> None:
    """Raises ImportError unless the extension is built. The extension Horovod names
    (e.g. ``check_extension('horovod.torch', 'HOROVOD_WITH_PYTORCH', __file__,
    'mpi_lib_v2')``) is horovod_torch's ``_C`` for PyTorch."""
    path = get_extension_full_path(pkg_path, *args) if args else None
    if path is not None and os.path.exists(path):
        return
    if ext_name.split(".")[-1] in _TORCH_NAMES or ext_name in _TORCH_NAMES:
        ours = _torch_extension_path()
        if os.path.exists(ours):
            return
        raise ImportError(f"Extension {ext_name} has not been built: {ours} not found. "
                          "Build horovod_torch (`make`) and check the build's output.")
    raise ImportError(f"Extension {ext_name} is not part of horovod_torch, which provides "
                      f"the PyTorch extension only ({ext_env_var} has no effect here).")


def _torch_ext(verbose: bool = False):
    """horovod_torch's basics if its extension loads, else None."""
    try:
        basics = importlib.import_module("horovod_torch.engine.basics")
    except Exception as e:  # the extension did not load
        if verbose:
            print(f"Extension torch could not be loaded: {e}")
        return None
    return basics


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the extension for framework `ext_base_name` ('torch', 'tensorflow',
    'mxnet') is built and loads."""
    ok = ext_base_name in _TORCH_NAMES and _torch_ext(verbose) is not None
    if verbose:
        print(f"Extension {ext_base_name} {'was' if ok else 'was NOT'} built.")
    return ok


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework's extension is available and a GPU can be used."""
    if not extension_available(ext_base_name, verbose):
        return False
    import torch
    ok = bool(torch.cuda.is_available())
    if verbose:
        print(f"Extension {ext_base_name} {'is' if ok else 'is NOT'} running with GPU.")
    return ok


def _probe(what: str, verbose: bool):
    """What the extension answers for `what` (None when no extension loads)."""
    basics = _torch_ext(verbose)
    if basics is None:
        return None
    result = getattr(basics, what)()
    if verbose:
        print(f"horovod_torch: {what}() = {result!r}")
    return result


def mpi_built(verbose: bool = False) -> Optional[bool]:
    return _probe("mpi_built", verbose)


def gloo_built(verbose: bool = False) -> Optional[bool]:
    """True: horovod_torch's TCP transport stands in for Gloo."""
    return _probe("gloo_built", verbose)


def nccl_built(verbose: bool = False) -> Optional[int]:
    """The NCCL version code the extension was built with, 0 without NCCL."""
    return _probe("nccl_built", verbose)


def ddl_built(verbose: bool = False) -> Optional[bool]:
    return _probe("ddl_built", verbose)


def ccl_built(verbose: bool = False) -> Optional[bool]:
    return _probe("ccl_built", verbose)


@contextlib.contextmanager
def env(**kwargs: Optional[str]) -> Iterator[None]:
    """Sets environment variables for the duration of a ``with`` block (arguments that
    are None are ignored) and puts the previous values back afterwards."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    before = {k: os.environ.get(k) for k in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[Any, Any], Any]:
    """Returns ``fn(op, average)`` giving the reduction op to use: `op` if given;
    else ``reduce_ops.Average`` / ``reduce_ops.Sum`` for ``average=True`` / ``False``
    (deprecated, with a DeprecationWarning); else Average. Both given: ValueError."""
    def resolve(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average; "
                                 "give only one of them.")
            return op
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be "
                          "removed", DeprecationWarning)
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average
    return resolve


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether `num_rank` is a power of two (1, 2, 4, ...), as Adasum needs."""
    return num_rank > 0 and (num_rank & (num_rank - 1)) == 0


def split_list(items: Sequence, n: int) -> List[Sequence]:
    """`items` cut into `n` consecutive chunks whose lengths differ by at most one (the
    longer ones first)."""
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _installed_versions() -> dict:
    """Versions of the frameworks the extension was built against, as far as known:
    the extension is built in place against the PyTorch it loads with, so that is
    the torch imported here."""
    import torch
    return {"pytorch": torch.__version__, "torch": torch.__version__}


def check_installed_version(name: str, version: str, exception: Optional[BaseException] = None
                            ) -> None:
    """Warns (or, given the `exception` a failed import raised, raises
    HorovodVersionMismatchError from it) when framework `name` is found at `version`
    but the extension was built against another one."""
    installed = _installed_versions().get(name)
    if installed is None or installed == version:
        return
    if exception is None:
        warnings.warn(get_version_mismatch_message(name, version, installed))
    else:
        raise HorovodVersionMismatchError(name, version, installed) from exception


def is_iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version `ver` >= `target` ("major.minor.patch")."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"versions must be strings; got ver={ver!r} ({type(ver).__name__}), "
                         f"target={target!r} ({type(target).__name__})")
    if len(target.split(".")) != 3:
        raise ValueError(f"target must be a version major.minor.patch; got {target!r}")
    from packaging import version
    return version.parse(ver) >= version.parse(target)
