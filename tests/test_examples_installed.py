"""Every example in examples/ runs against an installed package, from outside the
checkout: the package (horovod_torch and horovod, with the built extension) is copied
into a site folder of its own and put on PYTHONPATH, ahead of the editable install. The
examples are copied into an unbuilt source tree (the package's sources without the
extension), as in a fresh clone beside a pip-installed package: an example that puts
its tree first on the path would import the unbuilt package and fail. Everything runs
from an empty working directory, each example in its smallest setting."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

pytest.importorskip("torchvision")

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


SITECUSTOMIZE = """import sys
def _editable(f):
    return getattr(f, "__module__", "").startswith("__editable__")
sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
sys.path_importer_cache.clear()
"""


class Installed:
    def __init__(self, root: Path):
        self.site = root / "site"  # the "installed" package
        tree = root / "clone"  # an unbuilt source tree holding the examples
        self.examples = tree / "examples"
        self.work = root / "work"  # the working directory
        for package in ("horovod_torch", "horovod"):
            shutil.copytree(REPO / package, self.site / package, ignore=IGNORE)
            shutil.copytree(REPO / package, tree / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so",
                                                          "_build_info.py"))
        shutil.copytree(REPO / "examples", self.examples, ignore=IGNORE)
        # This environment has the checkout installed editable: its import hook would
        # still find the checkout's modules. Without it, as after `pip install .`.
        (self.site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.work.mkdir()

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HOROVOD_", "OMPI_")) and k not in ("PYTHONPATH", "RANK")}
        env.update(PYTHONPATH=str(self.site), OMP_NUM_THREADS="1")
        return env

    def run(self, cmd: List[str], timeout: float = 240, **env) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=self.work, env=dict(self.env(), **env),
                              capture_output=True, text=True, timeout=timeout)

    def example(self, path: str, *args: str, np: int = 0, timeout: float = 240,
                **env) -> subprocess.CompletedProcess:
        script = [str(self.examples / path), *args]
        if np:
            return self.run([PY, "-m", "horovod_torch.runner", "-np", str(np), PY, *script],
                            timeout, **env)
        return self.run([PY, *script], timeout, **env)


def _explain(proc: subprocess.CompletedProcess) -> str:
    return (f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n"
            f"--- stderr\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def inst(tmp_path_factory) -> Installed:
    if not list((REPO / "horovod_torch").glob("_C*.so")):
        pytest.skip("the extension is not built in place (make build)")
    return Installed(tmp_path_factory.mktemp("installed"))


def test_the_copy_is_what_imports(inst):
    proc = inst.run([PY, "-c", "import sys, horovod_torch, horovod.torch as hvd, horovod_torch._C; "
                     "print(horovod_torch.__file__); print(horovod_torch._C.__file__); "
                     "print(any('__editable__' in str(f) for f in sys.meta_path))"])
    assert proc.returncode == 0, _explain(proc)
    package, ext, editable = proc.stdout.splitlines()
    assert package.startswith(str(inst.site)) and ext.startswith(str(inst.site)), _explain(proc)
    assert editable == "False", _explain(proc)
    # The unbuilt tree first on the path does not load: the examples must not put it there.
    proc = inst.run([PY, "-c", f"import sys; sys.path.insert(0, {str(inst.examples.parent)!r}); "
                     "import horovod_torch; horovod_torch.init()"])
    assert proc.returncode != 0 and "source tree whose C++ extension is not built" in proc.stderr, \
        _explain(proc)


def test_synthetic_benchmark_and_its_timeline_picture(inst):
    timeline = inst.work / "timeline.json"
    proc = inst.example("pytorch_synthetic_benchmark.py", "--model", "resnet18",
                        "--batch-size", "2", "--image-size", "32", "--num-warmup-batches", "1",
                        "--num-batches-per-iter", "1", "--num-iters", "2", "--no-cuda", np=2,
                        HOROVOD_TIMELINE=str(timeline))
    assert proc.returncode == 0 and "Total img/sec on 2 CPU(s)" in proc.stdout, _explain(proc)
    png = inst.work / "timeline.png"
    proc = inst.example("plot_timeline.py", str(timeline), str(png))
    assert proc.returncode == 0 and re.search(r"wrote .*: \d+ steps", proc.stdout), _explain(proc)


def test_mnist(inst):
    data = inst.work / "mnist"
    proc = inst.run([PY, "-m", "horovod_torch.data", "mnist", str(data), "--train-size", "400",
                     "--test-size", "100"])
    assert proc.returncode == 0, _explain(proc)
    proc = inst.example("pytorch_mnist.py", "--epochs", "1", "--data-dir", str(data),
                        "--batch-size", "8", "--test-batch-size", "100", np=2)
    assert proc.returncode == 0 and "Test set: Average loss" in proc.stdout, _explain(proc)


def test_elastic_demo(inst):
    proc = inst.example("elastic/demo.py", "--no-fault", "--epochs", "1", "--data-dir",
                        str(inst.work / "demo-data"), "--sync-dir", str(inst.work / "sync"),
                        timeout=300)
    assert proc.returncode == 0 and "test accuracy" in proc.stdout, _explain(proc)


def test_lightning(inst):
    proc = inst.example("lightning/lightning_train.py", "--epochs", "1",
                        "--out", str(inst.work / "lightning"), np=2)
    assert proc.returncode == 0 and "world size 2" in proc.stdout, _explain(proc)


def test_ray(inst):
    proc = inst.example("ray/ray_train.py", "--num-workers", "2", "--epochs", "2", timeout=300)
    assert proc.returncode == 0 and "rank 0 weights" in proc.stdout, _explain(proc)


def test_ray_elastic(inst):
    proc = inst.example("ray/ray_elastic.py", "--min-workers", "2", "--max-workers", "2",
                        "--steps", "6", timeout=300)
    assert proc.returncode == 0 and "finished at step" in proc.stdout, _explain(proc)


@pytest.mark.parametrize("script, marker", [
    ("spark/pytorch_spark_run.py", "results by rank"),
    ("spark/torch_distributor.py", "trained parameters"),
])
def test_spark(inst, script, marker):
    pytest.importorskip("pyspark")
    args = ["--epochs", "1"] if script.endswith("run.py") else []
    proc = inst.example(script, *args, timeout=300)
    assert proc.returncode == 0 and marker in proc.stdout, _explain(proc)


def test_torch_distributed_survivors(inst):
    proc = inst.example("torch_distributed/ddp_survivors.py", "--np", "3", "--fail-rank", "2",
                        "--fail-step", "3", "--steps", "6", timeout=180)
    assert proc.returncode == 0 and "finished 6 steps on 2 ranks" in proc.stdout, _explain(proc)


# Run by another example: the demo's job is the OCI elastic train.py, unchanged.
RUN_BY_THE_DEMO = os.path.join("elastic", "train.py")


def test_every_example_is_run_here():
    named = set(re.findall(r'"([\w/]+\.py)"', Path(__file__).read_text()))
    scripts = {str(p.relative_to(REPO / "examples")) for p in (REPO / "examples").rglob("*.py")}
    assert scripts - named == {RUN_BY_THE_DEMO}, scripts - named
