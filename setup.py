"""Builds horovod_torch and its C++ core, horovod_torch._C.

Optional parts are whole source folders compiled or not (DESIGN.md §2). Each is
detected; HOROVOD_WITH_<PART>=1 forces it on (a build error if it cannot be built),
HOROVOD_WITHOUT_<PART>=1 forces it off.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CORE_DIRS = ["common", "wire", "rendezvous", "transport", "core", "python"]


def _sources(folder):
    return sorted(glob.glob(os.path.join("csrc", folder, "*.cc")))


def _optional_part(name, folder, detect):
    """Returns True if the optional part `name` is to be built."""
    force_on = os.environ.get(f"HOROVOD_WITH_{name}") == "1"
    force_off = os.environ.get(f"HOROVOD_WITHOUT_{name}") == "1"
    if force_off:
        return False
    have_sources = os.path.isdir(os.path.join(ROOT, "csrc", folder))
    reason = None
    if not have_sources:
        reason = f"this source tree has no {name} backend (csrc/{folder}) yet"
    elif not detect():
        reason = f"{name} headers/libraries were not found"
    if reason and force_on:
        raise SystemExit(f"HOROVOD_WITH_{name}=1 but {reason}")
    if reason:
        print(f"horovod_torch: building without {name}: {reason}")
        return False
    return True


_optional_part("NCCL", "nccl", lambda: False)
_optional_part("MPI", "mpi", lambda: shutil.which("mpicxx") is not None)

sources = [s for d in CORE_DIRS for s in _sources(d)]


def _cxx_std():
    """Our code is C++17; newer torch headers demand C++20, so follow them."""
    import torch.utils.cpp_extension as ext
    aten = os.path.join(ext.include_paths()[0], "ATen", "ATen.h")
    try:
        with open(aten) as f:
            return "-std=c++20" if "C++20" in f.read() else "-std=c++17"
    except OSError:
        return "-std=c++17"


# HOROVOD_TORCH_SKIP_EXT=1: install the Python package and entry points only; the
# Makefile then builds the extension in place, incrementally (python setup.py build_ext).
ext_modules = [] if os.environ.get("HOROVOD_TORCH_SKIP_EXT") == "1" else [
    CppExtension(
        "horovod_torch._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", _cxx_std(), "-Wall"]},
    )
]

setup(
    name="horovod_torch",
    version="0.1.0",
    description="Distributed data-parallel training for PyTorch with Horovod's API",
    packages=find_packages(include=["horovod_torch", "horovod_torch.*", "horovod", "horovod.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["horovodrun = horovod_torch.runner.launch:main"]},
    python_requires=">=3.9",
)
