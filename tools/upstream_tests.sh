#!/usr/bin/env bash
# Runs upstream Horovod's own PyTorch tests, unmodified, against the installed horovod_torch
# (docs/compat.md). Upstream's tests are never copied into this repository: give a local copy.
#
#   HOROVOD_UPSTREAM=/path/to/horovod tools/upstream_tests.sh [NP...]      (default NP: 2 3)
#
# HOROVOD_UPSTREAM is a work tree of github.com/horovod/horovod or a bare git mirror of it
# (its HEAD's test/ is extracted). Without it the script says so and exits 0.
# Runs, in one pytest session per rank as upstream's CI does:
#   horovodrun -np NP pytest test/parallel/test_torch.py          for each NP
#   horovodrun -np 2  pytest test/parallel/test_adasum_pytorch.py  (what applies without MPI)
#   pytest test/single/test_torch_elastic.py
# and prints one line per test and rank, then the counts. PYTHON picks the interpreter
# (default python3), UPSTREAM_OUT the result folder (default: a temporary one),
# UPSTREAM_TIMEOUT the limit of one run in seconds (default 1500), UPSTREAM_TEST_TIMEOUT
# that of one test (default 90; pytest-timeout).
set -uo pipefail
if [ -z "${HOROVOD_UPSTREAM:-}" ]; then
  echo "upstream_tests: HOROVOD_UPSTREAM is not set (a horovod/horovod checkout or mirror); skipped"
  exit 0
fi
PYTHON=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
out=${UPSTREAM_OUT:-$(mktemp -d /tmp/hvd-upstream.XXXX)}
limit=${UPSTREAM_TIMEOUT:-1500}
mkdir -p "$out"
src=$(mktemp -d /tmp/hvd-upstream-src.XXXX)
if [ -d "$HOROVOD_UPSTREAM/test/parallel" ]; then
  cp -r "$HOROVOD_UPSTREAM/test" "$src/"
else
  git --git-dir "$HOROVOD_UPSTREAM" archive HEAD test | tar -x -C "$src" || {
    echo "upstream_tests: $HOROVOD_UPSTREAM is neither a work tree nor a git mirror" >&2; exit 2; }
fi
"$PYTHON" -c "import mock, cloudpickle, pytest, packaging, pytest_timeout" 2>/dev/null ||
  "$PYTHON" -m pip install -q mock cloudpickle pytest packaging pytest-timeout
# A test that hangs fails after this many seconds (our waits see Python's signals).
per_test=${UPSTREAM_TEST_TIMEOUT:-90}

# One pytest session per rank; each rank writes its own junit file.
run_parallel() {  # NP FILE TAG
  local np=$1 file=$2 tag=$3
  (cd "$src/test/parallel" && timeout -k 10 "$limit" horovodrun -np "$np" \
     sh -c "exec $PYTHON -m pytest -q -p no:cacheprovider --timeout $per_test --junitxml=$out/$tag.rank\${HOROVOD_RANK}.xml $file" \
     >"$out/$tag.log" 2>&1)
  echo "upstream_tests: $tag exited $? (log: $out/$tag.log)"
}
for np in ${@:-2 3}; do run_parallel "$np" test_torch.py "test_torch.np$np"; done
run_parallel 2 test_adasum_pytorch.py test_adasum_pytorch.np2
(cd "$src/test/single" && timeout -k 10 "$limit" "$PYTHON" -m pytest -q -p no:cacheprovider --timeout "$per_test" \
   --junitxml="$out/test_torch_elastic.xml" test_torch_elastic.py >"$out/test_torch_elastic.log" 2>&1)
echo "upstream_tests: test_torch_elastic exited $? (log: $out/test_torch_elastic.log)"
"$PYTHON" "$here/junit_summary.py" "$out"/*.xml
