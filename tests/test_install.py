"""The installed package says what is wrong with its extension instead of crashing.

Each case imports horovod_torch in a fresh interpreter with one thing changed: the
torch version the extension was built against, or the extension missing.
"""
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _import_with(prelude: str) -> subprocess.CompletedProcess:
    code = prelude + "\nimport horovod.torch as hvd\nprint('imported')\n"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_extension_built_for_another_torch_names_both_versions_and_the_fix():
    # What horovod_torch/_build_info.py says after building against torch 2.0.1.
    out = _import_with(
        "import sys, types\n"
        "info = types.ModuleType('horovod_torch._build_info')\n"
        "info.TORCH_VERSION = '2.0.1'\n"
        "sys.modules['horovod_torch._build_info'] = info\n")
    assert out.returncode != 0 and "imported" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:"), out.stderr
    assert "torch 2.0.1" in last and f"torch {torch.__version__}" in last
    assert "pip install --no-build-isolation" in last


def test_missing_extension_says_how_to_build_it():
    out = _import_with(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'horovod_torch._C':\n"
        "            raise ModuleNotFoundError(\"No module named 'horovod_torch._C'\")\n"
        "sys.meta_path.insert(0, Block())\n")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "C++ extension (horovod_torch._C) is not built" in last, out.stderr
    assert "pip install ." in last


def test_unbuilt_source_tree_hiding_the_built_package_is_named(tmp_path):
    # A source tree first on the path (an example run from a checkout, PYTHONPATH set to
    # it) whose extension is not built, while a built horovod_torch sits later on the
    # path: the error names both, not the torch version.
    import shutil
    tree = tmp_path / "checkout"
    shutil.copytree(REPO / "horovod_torch", tree / "horovod_torch",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # An editable install's finder would resolve horovod_torch._C by name to the
    # checkout's build whatever the package's folder: leave it out, as a plain install.
    code = ("import sys\n"
            "sys.meta_path = [f for f in sys.meta_path\n"
            "                 if 'Editable' not in getattr(f, '__name__', type(f).__name__)]\n"
            "import horovod_torch\n"
            "horovod_torch._C\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:"), out.stderr
    assert f"imported from {tree / 'horovod_torch'}" in last, last
    assert f"hides the built horovod_torch at {REPO / 'horovod_torch'}" in last, last
    assert "torch " + torch.__version__ not in last, last


def test_matching_build_imports():
    out = _import_with("")
    assert out.returncode == 0, out.stderr
    assert "imported" in out.stdout


def test_launcher_loads_neither_torch_nor_the_extension():
    """horovodrun starts in a fresh interpreter without importing torch or _C (they
    take seconds and the launcher needs neither); the API loads them on first use."""
    probe = (
        "import sys\n"
        "from horovod_torch.runner import launch\n"
        "try:\n"
        "    launch.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('loaded:', sorted(m for m in sys.modules if m in ('torch', 'horovod_torch._C')))\n"
        "import horovod_torch as hvd\n"
        "hvd.size\n"
        "print('then:', sorted(m for m in sys.modules if m in ('torch', 'horovod_torch._C')))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout, out.stdout
    assert "then: ['horovod_torch._C', 'torch']" in out.stdout, out.stdout


def test_upstream_horovod_installed_beside_us_is_named_at_import(tmp_path):
    """Both distributions install a 'horovod' package; with upstream's metadata in the
    environment, `import horovod` says the files are mixed. Without it, nothing."""
    from tests.harness import ROOT
    site = tmp_path / "site"
    (site / "horovod-0.28.1.dist-info").mkdir(parents=True)
    (site / "horovod-0.28.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1\n")
    code = "import horovod"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(site)]))
    mixed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
    assert mixed.returncode == 0
    assert "upstream Horovod 0.28.1 is installed in this environment" in mixed.stderr
    env["PYTHONPATH"] = ROOT
    clean = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env,
                           capture_output=True, text=True, timeout=60)
    assert clean.returncode == 0 and clean.stderr == "", clean.stderr
