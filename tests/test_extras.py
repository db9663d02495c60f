"""Optional dependencies: each is declared as an extra in pyproject.toml, installed by
`make test` (requirements-dev.txt), and, when missing, the feature that needs it says
which extra to install (horovod_torch/common/extras.py)."""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from horovod_torch import extras

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def _names(requirements):
    return {re.split(r"[<>=!~\[; ]", r.strip())[0].lower() for r in requirements if r.strip()}


def test_every_provider_is_an_extra_and_all_holds_every_extra():
    for module, (dist, extra) in extras.PROVIDERS.items():
        assert dist in _names(EXTRAS[extra]), (module, extra)
    everything = EXTRAS["all"]
    assert len(everything) == 1
    named = set(re.search(r"\[(.*)\]", everything[0]).group(1).split(","))
    assert named == set(EXTRAS) - {"all"}


def test_make_test_installs_every_extra():
    dev = REPO / "requirements-dev.txt"
    have = _names(line for line in dev.read_text().splitlines() if not line.startswith("#"))
    pins = re.search(r"^TORCH_PINS \?= (.*)$", (REPO / "Makefile").read_text(), re.M)
    have |= _names(pins.group(1).split())  # torch and torchvision, installed first
    for extra, requirements in EXTRAS.items():
        if extra != "all":
            assert _names(requirements) <= have, (extra, _names(requirements) - have)


def test_requires_python_matches_the_readme():
    readme = (REPO / "README.md").read_text()
    minimum = re.search(r"Python (3\.\d+) or newer", readme).group(1)
    assert PROJECT["requires-python"] == f">={minimum}"


def _without(modules, code):
    """Runs `code` in a fresh interpreter in which `modules` cannot be imported."""
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)
    return subprocess.run([sys.executable, "-c", f"import sys; {block}\n{code}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("modules, code, extra", [
    (["ray"], "import horovod_torch.ray", "ray"),
    (["lightning", "pytorch_lightning"], "import horovod_torch.lightning", "lightning"),
    (["pyspark"], "import horovod_torch.spark as s; s.run(print, num_proc=1)", "spark"),
    (["sklearn"], "from horovod_torch import data; data._generate(10, 10, 0)", "examples"),
    (["matplotlib"], "import runpy; runpy.run_path('examples/plot_timeline.py')", "timeline"),
])
def test_a_missing_dependency_names_its_extra(modules, code, extra):
    r = _without(modules, code)
    assert r.returncode != 0
    assert "ImportError: " in r.stderr, r.stderr[-2000:]
    assert f"pip install 'horovod_torch[{extra}]'" in r.stderr, r.stderr[-2000:]


def test_a_package_missing_its_own_dependency_is_not_blamed_on_the_extra(tmp_path, monkeypatch):
    (tmp_path / "fakepkg.py").write_text("import fakepkg_needs_this\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(extras.PROVIDERS, "fakepkg", ("fakepkg", "examples"))
    with pytest.raises(ImportError) as info:
        extras.require("fakepkg", "a test")
    assert info.value.name == "fakepkg_needs_this"
    assert "horovod_torch[" not in str(info.value)
