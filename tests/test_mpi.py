"""The MPI controller: the same worker functions as the TCP tests, started by
OpenMPI's mpirun (as root in CI: --allow-run-as-root --oversubscribe)."""
import os
import shutil
import subprocess
import sys

import pytest

from horovod_torch import _C
from tests.harness import ROOT

pytestmark = pytest.mark.skipif(not _C.mpi_built() or shutil.which("mpirun") is None,
                                reason="this build has no MPI (install libopenmpi-dev, rebuild)")


def mpirun(target, np, args=(), env=None, timeout=180):
    full = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {}))
    for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_STORE_ADDR", "HOROVOD_STORE_PORT"):
        full.pop(k, None)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
           "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo",
           "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
           *[a for k in (env or {}) for a in ("-x", k)],
           sys.executable, "-m", "tests.run_worker", target, *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, env=full, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-6000:]
    return out.stdout


def test_all_collectives_over_mpi():
    mpirun("tests.workers:all_collectives", 2, args=[3])


def test_mismatches_and_local_errors_over_mpi():
    mpirun("tests.workers:mismatches", 2)
    mpirun("tests.workers:local_errors", 2)


def test_optimizer_exactness_over_mpi():
    mpirun("tests.optimizer_workers:exactness", 2, args=["adam", "average", 2, "none"])


def test_process_sets_over_mpi():
    mpirun("tests.process_set_workers:static_sets", 4, timeout=240)


def test_init_with_a_list_of_ranks():
    out = mpirun("tests.process_set_workers:mpi_comm_subset", 3)
    assert "outside as expected" in out


def test_controller_env_is_validated():
    out = subprocess.run([sys.executable, "-c", "import horovod_torch as h; h.init()"],
                         env=dict(os.environ, HOROVOD_CONTROLLER="nccl"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "HOROVOD_CONTROLLER='nccl' is not valid" in out.stderr


def test_init_with_an_mpi4py_communicator():
    pytest.importorskip("mpi4py")
    mpirun("tests.process_set_workers:mpi4py_comm", 4)


def test_horovodrun_mpi():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run(["horovodrun", "--mpi", "-np", "2",
                          "--mpi-args", "--mca btl self,tcp --mca btl_tcp_if_include lo",
                          sys.executable, "-m", "tests.run_worker",
                          "tests.process_set_workers:mpi_world_probe"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-4000:]
    assert out.stdout.count("MPI WORLD size=2 mpi=True") == 2, out.stdout


def test_send_recv_and_groups_of_the_hvd_backend_over_mpi():
    from tests.harness import master_port
    out = mpirun("tests.torch_distributed_workers:p2p_over_mpi", 3, args=[master_port()])
    assert out.count("transport=mpi") == 3, out[-3000:]
