#!/usr/bin/env python3
"""Checks the layering of docs/design.md §1: which part may include or import which.

    python tools/check_layers.py        # prints every forbidden arrow; exit 1 if any

C++: every `#include "part/file.h"` in csrc/PART/ must point to a part PART may use,
and the third-party headers (torch, CUDA, NCCL, MPI, pybind11) may appear only in the
parts listed for them. Python: every module-level import of a horovod_torch module
must point to a layer the importing module's layer may use (imports inside functions
are the way to go upward lazily, and are not checked), and the module-level imports
must have no cycle. The allowed arrows are written once, below.
"""
import ast
import re
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]

# C++ parts and the parts each may include (itself always). common <- wire <-
# rendezvous <- transport <- core <- python; mpi is a transport; nccl is a plugin of
# core (it implements core/gpu_backend.h, and core finds it through its registry).
CPP_USES: Dict[str, Set[str]] = {
    "common": set(),
    "wire": {"common"},
    "rendezvous": {"common", "wire"},
    "transport": {"common", "wire", "rendezvous"},
    "mpi": {"common", "wire", "rendezvous", "transport"},
    "core": {"common", "wire", "rendezvous", "transport"},
    "nccl": {"common", "wire", "core"},
    "python": {"common", "wire", "rendezvous", "transport", "core", "mpi"},  # mpi: its setup
}
# Third-party headers (by their first path component) and the parts that may use them.
CPP_EXTERNAL: Dict[str, Set[str]] = {
    "torch": {"python"},
    "ATen": {"core", "nccl", "python"},
    "c10": {"core", "nccl", "python"},
    "pybind11": {"python"},
    "cuda_runtime_api.h": {"nccl"},
    "cuda_runtime.h": {"nccl"},
    "nccl.h": {"nccl"},
    "mpi.h": {"mpi"},
    # No iostreams anywhere in csrc/: they can crash when the extension and the host
    # process carry different libstdc++ builds (common/logging.h).
    "sstream": set(), "iostream": set(), "istream": set(), "ostream": set(),
    "fstream": set(), "iomanip": set(),
}

# Python layers, lowest first, each a folder of horovod_torch/ (docs/design.md §1); a
# module may import its own layer and the ones below, except that "runner" (horovodrun,
# torch-free) may only use "common". The package's top-level files belong to the layer
# named for them here; any other module outside a layer folder is refused.
PY_LAYERS: List[str] = ["common", "runner", "engine", "collectives", "training",
                        "integrations", "api"]
PY_TOP_LEVEL: Dict[str, str] = {
    "horovod_torch": "common",            # __init__: lazy API, the alias finder
    "horovod_torch._aliases": "common",   # old and Horovod's import paths
    "horovod_torch._build_info": "common",  # written by setup.py
    "horovod_torch._C": "engine",         # the C++ extension
    "horovod_torch._api": "api",          # the public names
}
PY_USES: Dict[str, Set[str]] = {"runner": {"common"}}
PY_NO_TORCH = {"common", "runner"}  # layers that must not import torch at module level


def _py_layer(module: str) -> str:
    """The layer of a module: its folder's, or PY_TOP_LEVEL's entry ("" for neither)."""
    if module in PY_TOP_LEVEL:
        return PY_TOP_LEVEL[module]
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "horovod_torch" and parts[1] in PY_LAYERS:
        return parts[1]
    return ""


def py_allowed(src: str, dst: str) -> bool:
    """May a module of layer `src` import one of layer `dst` at module level?"""
    if src in PY_USES:
        return dst == src or dst in PY_USES[src]
    if PY_LAYERS.index(dst) > PY_LAYERS.index(src):
        return False  # upward
    # The API does not depend on the launcher; only the integrations drive it.
    return dst != "runner" or src in ("integrations", "api")


def cpp_violations(part: str, includes: List[str]) -> List[str]:
    """Forbidden includes of one file of csrc/`part` (the quoted or bracketed names)."""
    out = []
    for inc in includes:
        head = inc.split("/")[0]
        if head in CPP_USES:
            if head != part and head not in CPP_USES[part]:
                out.append(f"{part} may not include {inc}")
        elif head in CPP_EXTERNAL and part not in CPP_EXTERNAL[head]:
            out.append(f"{part} may not include <{inc}>")
    return out


def check_cpp() -> List[str]:
    errors = []
    for f in sorted((ROOT / "csrc").rglob("*")):
        if f.suffix not in (".cc", ".h"):
            continue
        part = f.relative_to(ROOT / "csrc").parts[0]
        includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', f.read_text(), re.M)
        errors += [f"{f.relative_to(ROOT)}: {e}" for e in cpp_violations(part, includes)]
    return errors


# Control operations (barrier, join, process-set changes) have fields of their own
# (wire/message.h's ControlOp). The files that build, match or apply them; elsewhere
# (executors, backends, transports) a control op's fields must not be read.
CONTROL_FILES = {
    "csrc/wire/message.h", "csrc/wire/message.cc",            # the message
    "csrc/core/entry.h",                                       # ControlSubmission
    "csrc/core/runtime.h", "csrc/core/runtime.cc",             # applied by the Runtime
    "csrc/core/runtime_submit.cc", "csrc/core/runtime_control.cc",
    "csrc/core/controller.cc", "csrc/core/controller_match.cc",  # negotiated and matched
    "csrc/python/bindings.cc", "csrc/python/c10d_backend.cc",  # submitted
}
CONTROL_USE = re.compile(r"\bControlKind::|\bcontrol\.(kind|ranks|process_set|last_joined)\b|"
                         r"\bControlSubmission\(")


def control_uses(text: str) -> List[int]:
    """Lines of C++ source `text` that read or build a control op's fields."""
    return [i + 1 for i, line in enumerate(text.splitlines())
            if CONTROL_USE.search(line.split("//")[0])]


def check_control_ops() -> List[str]:
    errors = []
    for f in sorted((ROOT / "csrc").rglob("*")):
        rel = f.relative_to(ROOT).as_posix()
        if f.suffix not in (".cc", ".h") or rel in CONTROL_FILES:
            continue
        for line in control_uses(f.read_text()):
            errors.append(f"{rel}:{line}: reads a control op's fields; control ops are the "
                          "Runtime's (tools/check_layers.py CONTROL_FILES)")
    return errors


# One job per file: a source file over MAX_LINES lines is refused, except the files
# named here, with the reason (generated files and tables).
MAX_LINES = 500
LONG_FILES: Dict[str, str] = {}


def check_file_lengths() -> List[str]:
    errors = []
    sources = [f for f in (ROOT / "csrc").rglob("*") if f.suffix in (".cc", ".h")]
    sources += list((ROOT / "horovod_torch").rglob("*.py"))
    for f in sorted(sources):
        rel = f.relative_to(ROOT).as_posix()
        n = len(f.read_text().splitlines())
        if n > MAX_LINES and rel not in LONG_FILES:
            errors.append(f"{rel}: {n} lines, more than {MAX_LINES}; split it along its seams "
                          "(one job per file)")
    return errors


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(path: Path, module: str, everywhere: bool = False) -> Set[str]:
    """Modules imported at module level (also inside a top-level if/try), or with
    `everywhere` anywhere in the file (inside functions too)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: Set[str] = set()
    nodes = list(ast.walk(tree)) if everywhere else list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.If, ast.Try)) and not everywhere:
            nodes += node.body + node.orelse + getattr(node, "finalbody", [])
            nodes += [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if _is_module(sub) else base)
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return ((ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()
            or any((ROOT / rel.parent).glob(rel.name + ".*.so")))


# The modules that may touch os.environ (docs/design.md §1): one reads what a launcher
# says, one holds the knobs; the rest set the variables of a process they start or
# host, as horovodrun does for its workers, or are not the running library at all.
ENVIRON_MODULES: Dict[str, str] = {
    "horovod_torch.common.launch_env": "reads what the launcher said",
    "horovod_torch.common.config": "holds the knobs",
    "horovod_torch.common.build_vars": "Horovod's build variables, read by setup.py",
    "horovod_torch.common.util": "Horovod's util.env(): sets variables for a with-block",
    "horovod_torch.integrations.ray.worker": "a Ray actor's launcher: sets horovodrun's "
                                             "variables in it",
    "horovod_torch.integrations.ray.elastic": "a Ray actor's launcher: sets its "
                                              "CUDA_VISIBLE_DEVICES",
    "horovod_torch.integrations.spark.task": "a Spark task's launcher: the environment of "
                                             "its rank",
}


def environ_uses(path: Path) -> List[int]:
    """Lines of `path` that touch the process environment (os.environ, os.getenv,
    os.putenv, os.unsetenv, or environ imported from os)."""
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "environb", "getenv", "putenv", "unsetenv")):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "putenv") for a in node.names):
            lines.append(node.lineno)
    return sorted(set(lines))


def check_environ() -> List[str]:
    errors = []
    for f in sorted((ROOT / "horovod_torch").rglob("*.py")):
        module = _module_name(f)
        if module.startswith("horovod_torch.runner") or module in ENVIRON_MODULES:
            continue
        for line in environ_uses(f):
            errors.append(f"{f.relative_to(ROOT)}:{line}: reads or writes the environment; "
                          "launch variables go through horovod_torch.launch_env, knobs "
                          "through horovod_torch.config")
    return errors


def check_python() -> List[str]:
    errors = []
    graph: Dict[str, Set[str]] = {}
    for f in sorted((ROOT / "horovod_torch").rglob("*.py")):
        module = _module_name(f)
        src = _py_layer(module)
        if not src:
            errors.append(f"{f.relative_to(ROOT)}: module {module} is in no layer: put it "
                          "in a layer's folder (PY_LAYERS in tools/check_layers.py)")
            continue
        deps = _top_level_imports(f, module)
        graph[module] = {d for d in deps if d.startswith("horovod_torch")}
        if src in PY_NO_TORCH and any(d == "torch" or d.startswith("torch.") for d in deps):
            errors.append(f"{f.relative_to(ROOT)}: {src} layer may not import torch")
        for d in sorted(graph[module]):
            dst = _py_layer(d)
            if dst and not py_allowed(src, dst):
                errors.append(f"{f.relative_to(ROOT)}: {src} layer may not import {d} ({dst})")
        # An import inside a function counts for cycles too, unless it reaches up a
        # layer (the way a lower layer calls a higher one lazily): a cycle hidden in a
        # function is still two modules that need each other.
        graph[module] |= {d for d in _top_level_imports(f, module, everywhere=True)
                          if d.startswith("horovod_torch") and _py_layer(d)
                          and py_allowed(src, _py_layer(d))}
    errors += [f"import cycle: {' -> '.join(c)} (module level, or inside a function within "
               "a layer or downward)" for c in cycles(graph)]
    return errors


def _load_aliases():
    """horovod_torch/_aliases.py, loaded by path (torch-free; nothing else is imported)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "_hvd_aliases", ROOT / "horovod_torch" / "_aliases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alias_imports(path: Path, module: str, target) -> List[str]:
    """Imports in `path` (anywhere in it) that name a module by an alias, which
    `target` maps to the module's real name."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if target(name) != name:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}, an old "
                           f"or Horovod's path; import {target(name)}")
    return out


def check_alias_imports() -> List[str]:
    """The package and its horovod/ shims import modules by their real paths; the aliases
    (horovod_torch/_aliases.py) are for users' scripts."""
    target = _load_aliases().target
    errors = []
    for top in ("horovod_torch", "horovod"):
        for f in sorted((ROOT / top).rglob("*.py")):
            errors += alias_imports(f, _module_name(f), target)
    return errors


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected group of modules (a module importing its own
    package's __init__ while being imported by it is Python's normal package layout
    and is not counted)."""
    def edges(m):
        return [d for d in graph.get(m, ()) if d in graph and not m.startswith(d + ".")]
    found, state = [], {}

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in edges(m):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def main() -> int:
    errors = (check_cpp() + check_python() + check_environ() + check_control_ops() +
              check_file_lengths() + check_alias_imports())
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} problem(s); the allowed arrows, control-op files and long files "
              "are in tools/check_layers.py (docs/design.md §1)")
        return 1
    print("layering: every include and module-level import follows docs/design.md §1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
