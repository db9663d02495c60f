"""hvd.init() under other launchers: torchrun for real; SLURM's srun and OpenMPI's
mpirun by the variables they set, with the TCP transport (HOROVOD_CONTROLLER=gloo;
tests/test_mpi.py runs real mpirun jobs over MPI)."""
import os
import re
import socket
import subprocess
import sys

import pytest

from tests.harness import ROOT, master_port

PROBE = os.path.join(ROOT, "tests", "foreign_launchers_probe.py")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "SLURM_")) and
           k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    return env


def _probes(text):
    fields = r"rank=(\d+) size=(\d+) local_rank=(\d+) local_size=(\d+) cross_rank=(\d+) sum=(\d+)"
    keys = ("rank", "size", "local_rank", "local_size", "cross_rank", "sum")
    return sorted((dict(zip(keys, m)) for m in re.findall("PROBE " + fields, text)),
                  key=lambda d: int(d["rank"]))


def test_torchrun():
    port = master_port()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), PROBE],
                         env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    probes = _probes(out.stdout)
    assert [p["rank"] for p in probes] == ["0", "1"], out.stdout
    assert all(p["size"] == "2" and p["sum"] == "1" and p["local_size"] == "2" for p in probes)


def test_torchrun_when_master_port_plus_one_is_taken():
    """Rank 0's store goes to a free port when another process holds MASTER_PORT + 1, and
    the others learn it through torchrun's store (before: rank 0 failed, "Address already
    in use", as a CI run saw once)."""
    port = master_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port + 1))
    squatter.listen()
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                              "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                              PROBE], env=_clean_env(), capture_output=True, text=True,
                             timeout=120)
    finally:
        squatter.close()
    assert out.returncode == 0, out.stdout + out.stderr
    assert [p["sum"] for p in _probes(out.stdout)] == ["1", "1"], out.stdout


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_slurm_and_openmpi_variables(launcher):
    port = master_port()
    procs = []
    for r in range(2):
        if launcher == "srun":
            extra = dict(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_NNODES="1",
                         SLURM_LOCALID=str(r), SLURM_NODEID="0", SLURM_JOB_ID="42")
        else:
            extra = dict(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                         OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                         HOROVOD_CONTROLLER="gloo")
        env = _clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
        procs.append(subprocess.Popen([sys.executable, PROBE], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    probes = _probes("".join(outs))
    assert [(p["rank"], p["local_rank"], p["sum"]) for p in probes] == [("0", "0", "1"),
                                                                       ("1", "1", "1")]


@pytest.mark.parametrize("master", ["::1", "[::1]"])
def test_ipv6_master_address(master):
    """MASTER_ADDR=::1: rank 0's store listens on IPv6 loopback, the mesh listens where
    each rank reaches the store from (::1), and, shared memory off, the allreduce's
    bytes cross IPv6 sockets. Before: "does not resolve to an IPv4 address"."""
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = master_port()
    procs = []
    for r in range(2):
        env = _clean_env(MASTER_ADDR=master, MASTER_PORT=str(port), SLURM_PROCID=str(r),
                         SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_LOCALID=str(r),
                         SLURM_NODEID="0", SLURM_JOB_ID="43", HOROVOD_SHM_CONTROL="0",
                         HOROVOD_HIERARCHICAL_ALLREDUCE="0", HOROVOD_HIERARCHICAL_ALLGATHER="0")
        procs.append(subprocess.Popen([sys.executable, PROBE], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert [(p["rank"], p["sum"]) for p in _probes("".join(outs))] == [("0", "1"), ("1", "1")]


def test_foreign_launcher_without_address_is_a_clear_error():
    env = _clean_env(RANK="0", WORLD_SIZE="2")
    out = subprocess.run([sys.executable, PROBE], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "MASTER_ADDR and MASTER_PORT" in out.stderr, out.stderr


def test_openmpi_variables_without_mpirun_are_a_clear_error_over_mpi():
    from horovod_torch import _C
    if not _C.mpi_built():
        pytest.skip("this build has no MPI")
    env = _clean_env(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2",
                     OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    out = subprocess.run([sys.executable, PROBE], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "OMPI_COMM_WORLD_SIZE=2" in out.stderr and "HOROVOD_CONTROLLER=gloo" in out.stderr, \
        out.stderr
