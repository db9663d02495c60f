"""The import paths scripts use keep working now that the modules sit in layer folders
(horovod_torch/_aliases.py): the old paths and Horovod's name the very module objects at
the new places, patches through them reach the real module, pickles written with the
old paths load, and ``python -m`` runs an aliased module."""
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args] if args else [sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, cwd=str(REPO))


def test_every_old_path_is_the_module_at_its_new_place():
    from horovod_torch import _aliases
    optional = {"ray", "spark", "lightning"}  # their packages may not be installed
    code = ["import importlib, horovod_torch", "from horovod_torch import _aliases",
            "bad = []"]
    for old in _aliases.MOVED:
        if old.split(".")[0] in optional:
            continue
        code.append(f"a = importlib.import_module('horovod_torch.{old}')")
        code.append(f"b = importlib.import_module('horovod_torch.{_aliases.MOVED[old]}')")
        code.append(f"bad += [] if a is b and b.__spec__.name == b.__name__ else ['{old}']")
    code.append("print('BAD', bad)")
    out = _run("\n".join(code))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BAD []" in out.stdout, out.stdout


def test_horovods_paths_and_attribute_access_reach_the_same_modules():
    out = _run(
        "import horovod.torch as hvd, horovod_torch\n"
        "import horovod.torch.mpi_ops as m, horovod.torch.elastic.state as s\n"
        "from horovod_torch.collectives import mpi_ops\n"
        "from horovod_torch.training.elastic import state\n"
        "import horovod_torch.elastic.worker as w\n"
        "from horovod_torch.common import elastic_worker\n"
        "assert hvd is horovod_torch and m is mpi_ops and s is state\n"
        "assert w is elastic_worker\n"
        "assert hvd.elastic is horovod_torch.training.elastic\n"
        "assert horovod_torch.ops is horovod_torch.collectives.ops\n"
        "print('ok')\n")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_a_patch_through_an_old_path_reaches_the_real_module():
    from unittest import mock

    from horovod_torch.common import config
    with mock.patch("horovod_torch.config.knobs", return_value=[]) as patched:
        assert config.knobs is patched


def test_a_pickle_that_names_an_old_module_loads():
    from horovod_torch.common.exceptions import HorovodInternalError
    data = pickle.dumps(HorovodInternalError("x"), protocol=0)  # names are plain text
    old = data.replace(b"horovod_torch.common.exceptions", b"horovod_torch.exceptions")
    assert old != data
    restored = pickle.loads(old)
    assert type(restored) is HorovodInternalError


def test_a_missing_module_below_an_old_path_is_a_clear_import_error():
    with pytest.raises(ModuleNotFoundError, match="horovod_torch.ops.nope"):
        __import__("horovod_torch.ops.nope")


def test_python_dash_m_runs_an_aliased_module():
    out = _run("", "-m", "horovod_torch.config", "--markdown")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HOROVOD_FUSION_THRESHOLD" in out.stdout
