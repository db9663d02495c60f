#!/usr/bin/env bash
# Clang's thread-safety analysis over csrc/ (docs/design.md §1, common/thread_annotations.h):
# every file of the layers the build always compiles (common, wire, rendezvous,
# transport, core, python) is parsed with -Wthread-safety as an error, and so are the
# optional backends (csrc/nccl, csrc/mpi) the extension was last built with, with the
# include directories the build used (OPTIONAL_PARTS in horovod_torch/_build_info.py).
#
#   tools/check_thread_safety.sh [python]   # the Python whose torch headers to use
#
# Needs clang++ (tools/system-deps.sh installs it); exits 0 with a note without it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
CXX=${CLANGXX:-clang++}
if ! command -v "$CXX" >/dev/null; then
  echo "thread-safety check: $CXX not found (apt-get install clang); not run" >&2
  exit 0
fi
read -r TORCH PYINC < <("$PY" -c "import os, sysconfig, torch; \
print(os.path.dirname(torch.__file__), sysconfig.get_paths()['include'])")
FLAGS=(-std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety -Icsrc
       -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include" -I"$PYINC"
       -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C)
files=$(ls csrc/{common,wire,rendezvous,transport,core,python}/*.cc csrc/{nccl,mpi}/no_*.cc)
# The optional parts built, one line each: the part, then its include directories.
optional=$("$PY" -c "import runpy; info = runpy.run_path('horovod_torch/_build_info.py'); \
[print(p, *d) for p, d in info.get('OPTIONAL_PARTS', {}).items()]" 2>/dev/null || true)
checked="common wire rendezvous transport core python"
while read -r part dirs; do
  [ -n "$part" ] || continue
  files="$files $(ls csrc/"$part"/*.cc | grep -v /no_)"
  for d in $dirs; do FLAGS+=(-I"$d"); done
  checked="$checked $part"
done <<< "$optional"
# Two at a time; each prints its diagnostics and fails the check on an error.
if printf '%s\n' $files | xargs -P 2 -I{} "$CXX" "${FLAGS[@]}" {}; then
  echo "thread-safety check: $(echo $files | wc -w) files ($checked), no lock annotation violated"
else
  echo "thread-safety check: failed (see above; annotations in csrc/common/thread_annotations.h)" >&2
  exit 1
fi
