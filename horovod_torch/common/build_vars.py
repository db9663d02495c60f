"""Horovod's build variables, read by setup.py (standard library only: it is loaded by
path at build time, before the package exists).

Users build Horovod with ``HOROVOD_GPU_OPERATIONS=NCCL``, ``HOROVOD_WITH_MPI=1``,
``HOROVOD_NCCL_HOME`` and the like. Those with a meaning here are honoured:

- ``HOROVOD_WITH_<PART>=1`` / ``HOROVOD_WITHOUT_<PART>=1`` (PART: NCCL, MPI) force an
  optional part on (a build error if it cannot be built) or off;
- ``HOROVOD_GPU_OPERATIONS=NCCL`` (and ``HOROVOD_GPU_ALLREDUCE``, ``_ALLGATHER``,
  ``_BROADCAST``, ``_ALLTOALL``, ``_REDUCESCATTER`` set to NCCL) stand for
  ``HOROVOD_WITH_NCCL=1``; another value is an error (NCCL is this package's only GPU
  data plane);
- ``HOROVOD_NCCL_HOME``, ``HOROVOD_CUDA_HOME`` and ``HOROVOD_MPI_HOME`` stand for
  ``NCCL_HOME``, ``CUDA_HOME`` and ``MPI_HOME`` when those are unset.

The others (frameworks, Gloo, CPU operations, ...) are accepted, each with one line
saying it does nothing here.
"""
from typing import Dict, List, Mapping, Tuple

GPU_OP_VARS = ("HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE", "HOROVOD_GPU_ALLGATHER",
               "HOROVOD_GPU_BROADCAST", "HOROVOD_GPU_ALLTOALL", "HOROVOD_GPU_REDUCESCATTER")
HOMES = {"HOROVOD_NCCL_HOME": "NCCL_HOME", "HOROVOD_CUDA_HOME": "CUDA_HOME",
         "HOROVOD_MPI_HOME": "MPI_HOME"}
# Horovod build variables with no meaning here, and why.
NO_EFFECT = {
    "HOROVOD_WITH_PYTORCH": "this package is for PyTorch only",
    "HOROVOD_WITHOUT_PYTORCH": "this package is for PyTorch only",
    "HOROVOD_WITH_TENSORFLOW": "this package is for PyTorch only",
    "HOROVOD_WITHOUT_TENSORFLOW": "this package is for PyTorch only",
    "HOROVOD_WITH_MXNET": "this package is for PyTorch only",
    "HOROVOD_WITHOUT_MXNET": "this package is for PyTorch only",
    "HOROVOD_WITH_GLOO": "the TCP transport, which stands for Gloo, is always built",
    "HOROVOD_WITHOUT_GLOO": "the TCP transport, which stands for Gloo, is always built",
    "HOROVOD_CPU_OPERATIONS": "CPU collectives run over TCP and shared memory (MPI when "
                              "the job runs under mpirun)",
    "HOROVOD_GPU": "CUDA is found from the torch being built against",
    "HOROVOD_BUILD_ARCH_FLAGS": "the compiler flags are torch's",
    "HOROVOD_CMAKE": "the build uses setuptools and ninja, not CMake",
    "HOROVOD_DEBUG": "use CFLAGS/CXXFLAGS for a debug build",
}


def translate(environ: Mapping[str, str]) -> Tuple[Dict[str, str], List[str]]:
    """(variables to set for the build, lines to print) for Horovod's variables in
    `environ`; raises SystemExit for a value that cannot be honoured."""
    updates: Dict[str, str] = {}
    notes: List[str] = []
    for var in GPU_OP_VARS:
        value = environ.get(var)
        if not value:
            continue
        if value.upper() != "NCCL":
            raise SystemExit(f"{var}={value}: horovod_torch runs GPU collectives with NCCL "
                             f"only; set {var}=NCCL or leave it unset")
        if environ.get("HOROVOD_WITHOUT_NCCL") == "1":
            raise SystemExit(f"{var}=NCCL contradicts HOROVOD_WITHOUT_NCCL=1")
        updates["HOROVOD_WITH_NCCL"] = "1"
        notes.append(f"{var}=NCCL: building with NCCL (as HOROVOD_WITH_NCCL=1)")
    for ours, theirs in HOMES.items():
        if environ.get(ours) and not environ.get(theirs):
            updates[theirs] = environ[ours]
            notes.append(f"{ours}={environ[ours]}: used as {theirs}")
    for var, why in NO_EFFECT.items():
        if environ.get(var):
            notes.append(f"{var} has no effect in horovod_torch: {why}")
    return updates, notes
