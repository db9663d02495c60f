#!/usr/bin/env bash
# PyTorch's own torch.distributed tests (tools/torch_dist_tests.py) on gloo and on
# "hvd", then the tests that pass on gloo and not on hvd (tools/junit_summary.py).
#
#   tools/torch_dist_tests.sh [-k EXPR]      (default: every test of the class)
#
# Knobs: PYTHON (default .venv/bin/python, else python3), WORLD_SIZE (2),
# TORCH_DIST_OUT (/tmp/torch_dist_tests: gloo/ and hvd/ junit files and logs),
# TORCH_DIST_BACKENDS ("gloo hvd"). Needs expecttest and hypothesis (torch's test utilities).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${TORCH_DIST_OUT:-/tmp/torch_dist_tests}
K=()
if [ "${1:-}" = "-k" ]; then K=(-k "$2"); fi
for backend in ${TORCH_DIST_BACKENDS:-gloo hvd}; do
  mkdir -p "$OUT/$backend"
  tmp=$(mktemp -d)
  start=$SECONDS
  BACKEND=$backend WORLD_SIZE=${WORLD_SIZE:-2} TEMP_DIR=$tmp "$PY" -m pytest -q -p no:cacheprovider \
    tools/torch_dist_tests.py "${K[@]}" --junitxml="$OUT/$backend/torch_dist.xml" \
    >"$OUT/$backend/log.txt" 2>&1
  echo "torch_dist_tests: $backend: $(tail -1 "$OUT/$backend/log.txt") ($((SECONDS - start)) s)"
  rm -rf "$tmp"
done
if [ -d "$OUT/gloo" ] && [ -d "$OUT/hvd" ]; then
  "$PY" tools/junit_summary.py --compare "$OUT/gloo" "$OUT/hvd"
fi
