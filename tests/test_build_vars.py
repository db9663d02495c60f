"""Horovod's build variables (horovod_torch/common/build_vars.py, read by setup.py) and what
`horovodrun --check-build` says about a part the build left out."""
import os
import subprocess
import sys

import pytest

from horovod_torch import build_vars
from horovod_torch.runner import launch
from tests.harness import ROOT


def test_gpu_operations_nccl_forces_nccl_and_homes_map():
    updates, notes = build_vars.translate({
        "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_GPU_ALLREDUCE": "nccl",
        "HOROVOD_NCCL_HOME": "/opt/nccl", "HOROVOD_CUDA_HOME": "/opt/cuda",
        "CUDA_HOME": "/usr/local/cuda", "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITHOUT_GLOO": "1"})
    # NCCL_HOME was unset: HOROVOD_NCCL_HOME stands for it; CUDA_HOME was set: kept.
    assert updates == {"HOROVOD_WITH_NCCL": "1", "NCCL_HOME": "/opt/nccl"}
    assert any("HOROVOD_WITH_PYTORCH has no effect" in n for n in notes)
    assert any("HOROVOD_WITHOUT_GLOO has no effect" in n for n in notes)
    assert build_vars.translate({}) == ({}, [])


@pytest.mark.parametrize("env,message", [
    ({"HOROVOD_GPU_OPERATIONS": "MPI"}, "NCCL only"),
    ({"HOROVOD_GPU_ALLREDUCE": "DDL"}, "NCCL only"),
    ({"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_WITHOUT_NCCL": "1"}, "contradicts"),
])
def test_a_value_that_cannot_be_honoured_is_an_error(env, message):
    with pytest.raises(SystemExit, match=message):
        build_vars.translate(env)


def test_setup_py_honours_them():
    """setup.py itself: an unusable value stops the build with the message; a variable
    with no meaning here is one line."""
    env = dict(os.environ, HOROVOD_TORCH_SKIP_EXT="1")
    bad = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=dict(env, HOROVOD_GPU_OPERATIONS="MPI"))
    assert bad.returncode != 0 and "HOROVOD_GPU_OPERATIONS=MPI" in bad.stderr + bad.stdout
    ok = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=dict(env, HOROVOD_WITH_TENSORFLOW="1"))
    assert ok.returncode == 0, ok.stderr
    assert "HOROVOD_WITH_TENSORFLOW has no effect in horovod_torch" in ok.stdout


def test_check_build_says_why_mpi_is_missing_and_how_to_build_it():
    why = launch.why_not_built("MPI", {"MPI": "no MPI compiler wrapper (mpicxx) was found"},
                               wrapper="/usr/bin/mpicxx")
    assert why.startswith("not built: no MPI compiler wrapper (mpicxx) was found")
    assert "/usr/bin/mpicxx is here now" in why and "HOROVOD_WITH_MPI=1 pip install" in why
    assert launch.why_not_built("NCCL", {"NCCL": "HOROVOD_WITHOUT_NCCL=1 was set"}) == \
        "not built: HOROVOD_WITHOUT_NCCL=1 was set"
    assert launch.why_not_built("NCCL", {}) == "not built: the build recorded no reason"


def test_the_package_requires_the_torch_it_was_built_against(tmp_path):
    """The metadata of a build (egg_info on a copy of the tree, without compiling)
    pins torch to the release it compiles against."""
    import shutil

    import torch
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        os.makedirs(tmp_path / "src" / os.path.dirname(f), exist_ok=True)
        shutil.copy(os.path.join(ROOT, f), tmp_path / "src" / f)
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_TORCH_SKIP_EXT"}
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "-e", str(tmp_path)],
                   cwd=tmp_path / "src", env=env, capture_output=True, text=True, timeout=300,
                   check=True)
    requires = next(tmp_path.glob("*.egg-info")).joinpath("requires.txt").read_text()
    assert requires.splitlines()[0] == "torch==" + torch.__version__.split("+")[0], requires


def test_setup_finds_its_sources_from_any_directory(tmp_path):
    """setup.py run from another directory still finds csrc/'s files, so it does not
    report an optional part (NCCL, MPI) as missing from the source tree."""
    def notes(cwd):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "--name"],
                             cwd=cwd, capture_output=True, text=True, timeout=300)
        return [line for line in out.stdout.splitlines() if line.startswith("horovod_torch:")]
    here, elsewhere = notes(ROOT), notes(str(tmp_path))
    assert not any("has no" in line for line in elsewhere), elsewhere
    assert elsewhere == here
