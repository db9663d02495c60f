"""Builds horovod_torch and its C++ core, horovod_torch._C.

Optional parts are whole source folders compiled or not (docs/design.md §2). Each is
detected; HOROVOD_WITH_<PART>=1 forces it on (a build error if it cannot be built),
HOROVOD_WITHOUT_<PART>=1 forces it off.
"""
import glob
import importlib.util
import os
import shutil

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CORE_DIRS = ["common", "wire", "rendezvous", "transport", "core", "python"]


def _load_build_vars():
    """horovod_torch/common/build_vars.py, loaded by path (the package is not installed yet)."""
    spec = importlib.util.spec_from_file_location(
        "_hvd_build_vars", os.path.join(ROOT, "horovod_torch", "common", "build_vars.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Horovod's build variables (HOROVOD_GPU_OPERATIONS=NCCL, HOROVOD_NCCL_HOME, ...).
_updates, _notes = _load_build_vars().translate(os.environ)
os.environ.update(_updates)
for _note in _notes:
    print(f"horovod_torch: {_note}")
# Why an optional part was left out, for `horovodrun --check-build` (_build_info.py).
NOT_BUILT = {}


def _sources(folder):
    """The .cc files of csrc/`folder`, as paths relative to this file's directory (what
    setuptools wants), wherever setup.py is run from."""
    return sorted(glob.glob(os.path.join("csrc", folder, "*.cc"), root_dir=ROOT))


def _part_sources(folder, built):
    """An optional part's files when it is built, else only its stub (no_<folder>.cc)."""
    stub = os.path.join("csrc", folder, f"no_{folder}.cc")
    return [f for f in _sources(folder) if f != stub] if built else [stub]


def _optional_part(name, folder, detect):
    """Returns True if the optional part `name` is to be built."""
    force_on = os.environ.get(f"HOROVOD_WITH_{name}") == "1"
    force_off = os.environ.get(f"HOROVOD_WITHOUT_{name}") == "1"
    if force_off:
        NOT_BUILT[name] = f"HOROVOD_WITHOUT_{name}=1 was set"
        return False
    have_sources = bool(_part_sources(folder, True))
    reason = None
    if not have_sources:
        reason = f"this source tree has no {name} backend (csrc/{folder}) yet"
    elif not detect():
        reason = f"{name} headers/libraries were not found"
    if reason and force_on:
        raise SystemExit(f"HOROVOD_WITH_{name}=1 but {reason}")
    if reason:
        print(f"horovod_torch: building without {name}: {reason}")
        NOT_BUILT[name] = reason
        return False
    return True


def _find_nccl():
    """(include_dir, lib_dir) of NCCL and CUDA's runtime headers, or None.

    Looked for in NCCL_HOME, the nvidia-nccl wheel torch depends on, and the system.
    """
    import torch
    if torch.version.cuda is None:
        return None
    candidates = []
    if os.environ.get("NCCL_HOME"):
        home = os.environ["NCCL_HOME"]
        candidates.append((os.path.join(home, "include"), os.path.join(home, "lib")))
    try:
        import nvidia.nccl
        base = list(nvidia.nccl.__path__)[0]
        candidates.append((os.path.join(base, "include"), os.path.join(base, "lib")))
    except ImportError:
        pass
    candidates.append(("/usr/include", "/usr/lib/x86_64-linux-gnu"))
    for inc, lib in candidates:
        if os.path.exists(os.path.join(inc, "nccl.h")) and glob.glob(os.path.join(lib, "libnccl.so*")):
            return inc, lib
    return None


def _find_cuda_include():
    """Directory holding cuda_runtime_api.h (CUDA_HOME, the CUDA wheel, /usr/local/cuda)."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    try:
        import nvidia
        roots += [os.path.join(p, sub) for p in nvidia.__path__ for sub in ("cu13", "cuda_runtime")]
    except ImportError:
        pass
    for root in roots:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


NCCL = _find_nccl()
CUDA_INCLUDE = _find_cuda_include()
WITH_NCCL = _optional_part("NCCL", "nccl", lambda: NCCL is not None and CUDA_INCLUDE is not None)
def _mpi_flags():
    """(include_dirs, library_dirs, libraries) from the MPI compiler wrapper, or None.

    MPI_HOME/bin/mpicxx is preferred; OpenMPI's wrapper answers --showme:*, MPICH's -show.
    """
    wrapper = None
    if os.environ.get("MPI_HOME"):
        wrapper = shutil.which("mpicxx", path=os.path.join(os.environ["MPI_HOME"], "bin"))
    wrapper = wrapper or shutil.which("mpicxx")
    if wrapper is None:
        return None
    _mpi_flags.wrapper = wrapper
    import subprocess

    def run(*args):
        try:
            return subprocess.run([wrapper, *args], capture_output=True, text=True,
                                  timeout=30).stdout.split()
        except (OSError, subprocess.SubprocessError):
            return []
    words = run("--showme:compile") + run("--showme:link") or run("-show")
    inc = [w[2:] for w in words if w.startswith("-I")]
    libdirs = [w[2:] for w in words if w.startswith("-L")]
    libs = [w[2:] for w in words if w.startswith("-l")]
    if not libs:
        return None
    return inc, libdirs, libs


_mpi_flags.wrapper = None
MPI = _mpi_flags()
WITH_MPI = _optional_part("MPI", "mpi", lambda: MPI is not None)
if "MPI" in NOT_BUILT and MPI is None:
    NOT_BUILT["MPI"] = ("no MPI compiler wrapper (mpicxx) was found on PATH or in MPI_HOME/bin"
                        if _mpi_flags.wrapper is None else
                        f"{_mpi_flags.wrapper} named no MPI library")

# The parts always built, then each optional part or its stub (whole files, no #ifdef).
sources = ([s for d in CORE_DIRS for s in _sources(d)] + _part_sources("nccl", WITH_NCCL) +
           _part_sources("mpi", WITH_MPI))
include_dirs = [os.path.join(ROOT, "csrc")]
libraries, library_dirs, runtime_dirs = [], [], []
if WITH_NCCL:
    include_dirs += [NCCL[0], CUDA_INCLUDE]
    libraries += ["c10_cuda", "torch_cuda", ":" + os.path.basename(
        sorted(glob.glob(os.path.join(NCCL[1], "libnccl.so*")))[0])]
    library_dirs += [NCCL[1]]
    runtime_dirs += [NCCL[1]]
    print(f"horovod_torch: building with NCCL from {NCCL[0]}")
if WITH_MPI:
    include_dirs += MPI[0]
    libraries += MPI[2]
    library_dirs += MPI[1]
    runtime_dirs += MPI[1]
    print(f"horovod_torch: building with MPI ({', '.join(MPI[2])})")


def _cxx_std():
    """Our code is C++17; newer torch headers demand C++20, so follow them."""
    import torch.utils.cpp_extension as ext
    aten = os.path.join(ext.include_paths()[0], "ATen", "ATen.h")
    try:
        with open(aten) as f:
            return "-std=c++20" if "C++20" in f.read() else "-std=c++17"
    except OSError:
        return "-std=c++17"


def _record_torch_version():
    """Writes horovod_torch/_build_info.py: the torch the extension is compiled against.

    The extension only loads into that torch; horovod_torch/engine/extension.py compares it with
    the torch being imported and names both when they differ.
    """
    import torch
    with open(os.path.join(ROOT, "horovod_torch", "_build_info.py"), "w") as f:
        f.write('"""Written by setup.py when it builds the extension."""\n')
        f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
        f.write("# Optional parts left out, and why (horovodrun --check-build says it).\n")
        f.write(f"NOT_BUILT = {NOT_BUILT!r}\n")
        # The optional parts built and their include directories (the thread-safety check,
        # tools/check_thread_safety.sh, parses them with the same headers).
        parts = {}
        if WITH_NCCL:
            parts["nccl"] = [NCCL[0], CUDA_INCLUDE]
        if WITH_MPI:
            parts["mpi"] = list(MPI[0])
        f.write(f"OPTIONAL_PARTS = {parts!r}\n")


# Our own code compiles without warnings; HOROVOD_TORCH_WERROR=1 (CI) makes one an
# error. -fvisibility=hidden: pybind11's types are hidden, so ours must be as well
# (else "declared with greater visibility" warnings); only PyInit__C is exported.
CXX_FLAGS = ["-O3", _cxx_std(), "-Wall", "-fvisibility=hidden"]
if os.environ.get("HOROVOD_TORCH_WERROR") == "1":
    CXX_FLAGS.append("-Werror")

# The torch release the extension is built against (the local label, +cu130, dropped:
# "==2.14.1" matches any build of 2.14.1); unpinned when no extension is built.
TORCH_REQUIREMENT = "torch"

# HOROVOD_TORCH_SKIP_EXT=1: install the Python package and entry points only; the
# Makefile then builds the extension in place, incrementally (python setup.py build_ext).
ext_modules = []
if os.environ.get("HOROVOD_TORCH_SKIP_EXT") != "1":
    _record_torch_version()
    TORCH_REQUIREMENT = "torch==" + __import__("torch").__version__.split("+")[0]
    ext_modules = [
        CppExtension(
            "horovod_torch._C",
            sources,
            include_dirs=include_dirs,
            libraries=libraries,
            library_dirs=library_dirs,
            runtime_library_dirs=runtime_dirs,
            extra_compile_args={"cxx": CXX_FLAGS},
        )
    ]
    # pip shows nothing while this compiles (pip install -v . shows ninja's progress).
    print(f"horovod_torch: compiling {len(sources)} C++ files against torch "
          f"{__import__('torch').__version__}; about 3 minutes on 2 cores, less with "
          "more (MAX_JOBS=N limits the parallel jobs)", flush=True)

# The project's metadata is in pyproject.toml; what it marks dynamic is given here.
setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    # numpy: tensors to bytes (broadcast_object, optimizer state); cloudpickle:
    # horovod.run's functions; packaging: version checks of horovod.common.util.
    # The extension loads only into the torch it was compiled against: pin that release
    # (as torchvision does), so that `pip install -U torch` does not break it unseen.
    install_requires=[TORCH_REQUIREMENT, "numpy", "cloudpickle", "packaging"],
)
