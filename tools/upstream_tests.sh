#!/usr/bin/env bash
# Runs upstream Horovod's own PyTorch tests, unmodified, against whatever `horovod` the
# interpreter imports (docs/compat.md): ours, or upstream itself in its own environment,
# so that the same command measures both. It builds nothing. Upstream's tests are never
# copied into this repository: give a local copy.
#
#   HOROVOD_UPSTREAM=/path/to/horovod tools/upstream_tests.sh [NP...]      CPU (default NP: 2 3)
#   HOROVOD_UPSTREAM=/path/to/horovod tools/upstream_tests.sh --gpu [NP...] GPUs (default NP: 2,
#                                                                           and 4 with 4 GPUs)
#
# HOROVOD_UPSTREAM is a work tree of github.com/horovod/horovod or a bare git mirror of it
# (its HEAD's test/ is extracted). Without it the script says so and exits 0.
# Runs, in one pytest session per rank as upstream's CI does:
#   horovodrun -np NP pytest test/parallel/test_torch.py          for each NP
#   horovodrun -np 2  pytest test/parallel/test_adasum_pytorch.py  (NP 2 and 4 with --gpu)
#   pytest test/single/test_torch_elastic.py                       (CPU mode only)
#   pytest test/integration/test_elastic_torch.py                  (CPU mode only; through
#                                                  tools/upstream_elastic_shim.py, our horovodrun)
# streams pytest's verbose output and each failure's report (tools/pytest_stream_failures.py)
# to OUT/TAG.log as they come (a run cut off still leaves what it did and why),
# and prints one line per test and rank that did not pass, then the counts.
#
# Knobs: PYTHON (default python3), HOROVODRUN (default: horovodrun; upstream's is
# "/tmp/hvdpeer/bin/horovodrun --gloo"), UPSTREAM_OUT (result folder, default a temporary
# one), UPSTREAM_TIMEOUT (one run's limit in seconds, default 1500), UPSTREAM_TEST_TIMEOUT
# (one test's, default 90; pytest-timeout), UPSTREAM_TIMEOUT_METHOD (pytest-timeout's
# method, default signal; "thread" dumps every thread's Python stack and ends the rank's
# session when a test hangs in C code, where a signal is never handled: the rest of that
# session is lost, but the log says where it hung), UPSTREAM_K (a pytest -k expression).
# With --gpu, NCCL_NVLS_ENABLE=0 is set and CUDA_VISIBLE_DEVICES is respected.
set -uo pipefail
gpu=0
if [ "${1:-}" = "--gpu" ]; then gpu=1; shift; fi
if [ -z "${HOROVOD_UPSTREAM:-}" ]; then
  echo "upstream_tests: HOROVOD_UPSTREAM is not set (a horovod/horovod checkout or mirror); skipped"
  exit 0
fi
PYTHON=$(command -v "${PYTHON:-python3}") || { echo "upstream_tests: no interpreter ${PYTHON:-python3}" >&2; exit 2; }
PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")  # the ranks run elsewhere
HOROVODRUN=${HOROVODRUN:-horovodrun}
here=$(cd "$(dirname "$0")" && pwd)
out=${UPSTREAM_OUT:-$(mktemp -d /tmp/hvd-upstream.XXXX)}
limit=${UPSTREAM_TIMEOUT:-1500}
mkdir -p "$out"
out=$(cd "$out" && pwd)
src=$(mktemp -d /tmp/hvd-upstream-src.XXXX)
if [ -d "$HOROVOD_UPSTREAM/test/parallel" ]; then
  cp -r "$HOROVOD_UPSTREAM/test" "$src/"
else
  git --git-dir "$HOROVOD_UPSTREAM" archive HEAD test | tar -x -C "$src" || {
    echo "upstream_tests: $HOROVOD_UPSTREAM is neither a work tree nor a git mirror" >&2; exit 2; }
fi
"$PYTHON" -c "import mock, cloudpickle, pytest, packaging, pytest_timeout, psutil" 2>/dev/null ||
  "$PYTHON" -m pip install -q mock cloudpickle pytest packaging pytest-timeout psutil
# A test that hangs fails after this many seconds (our waits see Python's signals).
per_test=${UPSTREAM_TEST_TIMEOUT:-90}
export UPSTREAM_K=${UPSTREAM_K:-}  # read by each rank's shell below

# One pytest session per rank; each rank writes its own junit file, and the log gets
# every rank's verbose lines as they come.
run_parallel() {  # NP FILE TAG
  local np=$1 file=$2 tag=$3 t0=$SECONDS rc
  (cd "$src/test/parallel" && timeout -k 10 "$limit" $HOROVODRUN -np "$np" -H "localhost:$np" \
     env PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
     sh -c "exec $PYTHON -u -m pytest -v -rfE -p no:cacheprovider -p pytest_stream_failures \
            --timeout $per_test --timeout-method ${UPSTREAM_TIMEOUT_METHOD:-signal} \
            \${UPSTREAM_K:+-k \"\$UPSTREAM_K\"} \
            --junitxml=$out/$tag.rank\${HOROVOD_RANK:-\${OMPI_COMM_WORLD_RANK:-0}}.xml $file" \
     >"$out/$tag.log" 2>&1)
  rc=$?
  echo "upstream_tests: $tag exited $rc in $((SECONDS - t0)) s (log: $out/$tag.log)"
}
if [ "$gpu" = 1 ]; then
  export NCCL_NVLS_ENABLE=0
  ngpu=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$ngpu" -lt 2 ]; then echo "upstream_tests: --gpu needs 2 GPUs, found $ngpu" >&2; exit 2; fi
  nps=${*:-2 $([ "$ngpu" -ge 4 ] && echo 4)}
  for np in $nps; do
    if [ "$np" -gt "$ngpu" ]; then echo "upstream_tests: NP $np > $ngpu GPUs" >&2; exit 2; fi
    run_parallel "$np" test_torch.py "gpu_test_torch.np$np"
    run_parallel "$np" test_adasum_pytorch.py "gpu_test_adasum_pytorch.np$np"
  done
else
  for np in ${@:-2 3}; do run_parallel "$np" test_torch.py "test_torch.np$np"; done
  run_parallel 2 test_adasum_pytorch.py test_adasum_pytorch.np2
  (cd "$src/test/single" && timeout -k 10 "$limit" "$PYTHON" -m pytest -q -p no:cacheprovider \
     --timeout "$per_test" --junitxml="$out/test_torch_elastic.xml" test_torch_elastic.py \
     >"$out/test_torch_elastic.log" 2>&1)
  echo "upstream_tests: test_torch_elastic exited $? (log: $out/test_torch_elastic.log)"
  # Its elastic jobs take up to a minute each; upstream's elastic_common.py runs them.
  (cd "$src/test" && PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 "$limit" \
     "$PYTHON" -m pytest -v -p no:cacheprovider -p upstream_elastic_shim \
     -p pytest_stream_failures --timeout 300 --junitxml="$out/test_elastic_torch.xml" \
     integration/test_elastic_torch.py >"$out/test_elastic_torch.log" 2>&1)
  echo "upstream_tests: test_elastic_torch exited $? (log: $out/test_elastic_torch.log)"
fi
if ls "$out"/*.xml >/dev/null 2>&1; then
  "$PYTHON" "$here/junit_summary.py" "$out"/*.xml
else
  echo "upstream_tests: no test wrote a result (see the logs in $out)"; exit 1
fi
