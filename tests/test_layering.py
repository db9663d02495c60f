"""The layering of docs/design.md §1, checked by tools/check_layers.py: the tree
follows it, and the check does fail on a forbidden arrow."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import check_layers  # noqa: E402


def test_the_tree_follows_the_layering():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "check_layers.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cpp_arrows_against_the_layering_are_found():
    assert check_layers.cpp_violations("transport", ["core/runtime.h"])
    assert check_layers.cpp_violations("common", ["wire/message.h"])
    assert check_layers.cpp_violations("wire", ["torch/extension.h"])
    assert check_layers.cpp_violations("transport", ["ATen/ATen.h"])
    assert check_layers.cpp_violations("core", ["mpi.h"])
    assert check_layers.cpp_violations("common", ["sstream"])  # no iostreams at all
    assert not check_layers.cpp_violations("core", ["transport/transport.h", "ATen/ATen.h"])
    assert not check_layers.cpp_violations("nccl", ["core/gpu_backend.h", "nccl.h"])


def test_python_arrows_against_the_layering_are_found():
    assert not check_layers.py_allowed("runner", "engine")      # horovodrun loads no _C
    assert not check_layers.py_allowed("engine", "training")    # upward
    assert not check_layers.py_allowed("training", "runner")    # API -> launcher
    assert check_layers.py_allowed("training", "collectives")
    assert check_layers.py_allowed("integrations", "runner")
    assert check_layers.cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert check_layers.cycles({"pkg": {"pkg.x"}, "pkg.x": {"pkg"}}) == []


def test_a_module_belongs_to_the_layer_of_its_folder():
    assert check_layers._py_layer("horovod_torch.collectives.ops") == "collectives"
    assert check_layers._py_layer("horovod_torch.training.elastic.state") == "training"
    assert check_layers._py_layer("horovod_torch.runner") == "runner"
    assert check_layers._py_layer("horovod_torch._api") == "api"
    # A module beside the layer folders, not named in PY_TOP_LEVEL, is in none.
    assert check_layers._py_layer("horovod_torch.newthing") == ""
    assert check_layers._py_layer("horovod_torch.ops") == ""


def test_imports_by_an_old_or_horovods_path_inside_the_package_are_found(tmp_path,
                                                                          monkeypatch):
    target = check_layers._load_aliases().target
    pkg = tmp_path / "horovod_torch" / "training"
    pkg.mkdir(parents=True)
    f = pkg / "m.py"
    f.write_text("from horovod_torch import ops\n"                      # 1: old path
                 "import horovod_torch.basics\n"                         # 2: old path
                 "from horovod_torch.collectives import ops as fine\n"   # 3: real path
                 "def later():\n"
                 "    from ..elastic import worker\n"                    # 5: old, relative
                 "    from horovod.torch.mpi_ops import allreduce\n"     # 6: Horovod's
                 "from horovod_torch import _C\n")                       # 7: real
    assert check_layers.check_alias_imports() == []  # (the tree, before ROOT moves)
    monkeypatch.setattr(check_layers, "ROOT", tmp_path)
    found = check_layers.alias_imports(f, "horovod_torch.training.m", target)
    lines = sorted({int(e.split(":")[1]) for e in found})
    assert lines == [1, 2, 5, 6], found
    assert "import horovod_torch.common.elastic_worker" in " ".join(found)


def test_environment_reads_outside_launch_env_and_config_are_found(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom os import environ\nx = os.environ.get('HOROVOD_RANK')\n"
                 "y = os.getenv('A')\nz = environ['B']\nos.path.join('a', 'b')\n")
    assert check_layers.environ_uses(f) == [2, 3, 4]
    # The package itself: only the modules ENVIRON_MODULES names (and the runner) do it.
    assert check_layers.check_environ() == []
    assert "horovod_torch.integrations.lightning.strategy" not in check_layers.ENVIRON_MODULES
    assert "horovod_torch.integrations.torch_distributed" not in check_layers.ENVIRON_MODULES


def test_control_op_fields_read_outside_the_runtime_are_found():
    text = ("  switch (r.type) {\n"
            "    if (r.control.kind == ControlKind::kJoin) {}\n"
            "  // control.ranks in a comment is fine\n"
            "  Submission s = ControlSubmission(c, \"x\", 0);\n")
    assert check_layers.control_uses(text) == [2, 4]
    assert check_layers.check_control_ops() == []
    assert "csrc/core/host_executor.cc" not in check_layers.CONTROL_FILES
    assert "csrc/nccl/nccl_backend.cc" not in check_layers.CONTROL_FILES


def test_source_files_over_the_line_limit_are_found(tmp_path, monkeypatch):
    assert check_layers.check_file_lengths() == []
    monkeypatch.setattr(check_layers, "MAX_LINES", 50)
    errors = check_layers.check_file_lengths()
    assert any("csrc/core/runtime.cc" in e for e in errors), errors


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / "horovod_torch"
    for folder in ("collectives", "engine"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    # Within a layer: a imports b, b imports a inside a function.
    (pkg / "collectives" / "a.py").write_text("from horovod_torch.collectives import b\n")
    (pkg / "collectives" / "b.py").write_text(
        "def f():\n    from horovod_torch.collectives import a\n    return a\n")
    # Upward and lazy (engine reaching collectives in a function): the way up, no cycle.
    (pkg / "engine" / "e.py").write_text(
        "def f():\n    from horovod_torch.collectives import c\n    return c\n")
    (pkg / "collectives" / "c.py").write_text("from horovod_torch.engine import e\n")
    monkeypatch.setattr(check_layers, "ROOT", tmp_path)
    found = [e for e in check_layers.check_python() if "cycle" in e]
    assert found == ["import cycle: horovod_torch.collectives.a -> horovod_torch.collectives.b "
                     "-> horovod_torch.collectives.a (module level, or inside a function within "
                     "a layer or downward)"], found
