#!/usr/bin/env bash
# The routine for a change to the GPU path (csrc/nccl, csrc/core, the GPU side of the
# Python layer): on a machine with 2+ CUDA GPUs, build this checkout, run our GPU tests
# and upstream Horovod's suite on the GPUs against it, and print a short summary. CI has
# no GPU; the summary goes into the closing note.
#
#   tools/gpu_check.sh                      build, tests/test_gpu.py, upstream's suite (NP 2
#                                           and, with 4 GPUs, 4), compared with PEER_RESULTS
#
# Knobs (environment):
#   GPU_CHECK_STEPS   which steps, in order (default "build ours upstream"):
#                       build     the extension in place, the checkout installed editable
#                                 (as make build; MAX_JOBS=nproc)
#                       ours      pytest -m gpu tests/test_gpu.py (GPU_CHECK_K: a -k filter);
#                                 with 4 or more GPUs, one pytest session per pair of GPUs
#                                 (CUDA_VISIBLE_DEVICES), the tests dealt out among them, so
#                                 that tests for up to 4 GPUs run at 2 there
#                       upstream  tools/upstream_tests.sh --gpu against ours; with 4 or more
#                                 GPUs and "ours" in the steps, it runs beside "ours" (the
#                                 tests share the GPUs; the few of ours with time bounds
#                                 have slack for that: all passed so on 4 x H200)
#                       peer      build upstream 0.28.1 with PEER_BUILD (its own venv) and run
#                                 the same suite against it, into PEER_RESULTS
#   GPU_CHECK_NP      rank counts for the upstream suite (default: 2, and 4 with 4 GPUs)
#   GPU_CHECK_DEADLINE seconds for the whole routine (default 560); each step gets what is left
#   GPU_CHECK_NGPU    the GPUs to plan for (default: as many as torch sees; pairs are
#                     numbered from 0, so not more than there are)
#   HOROVOD_UPSTREAM  upstream's tests (default .carry/upstream: a folder holding test/)
#   PEER_BUILD        the peer build script (default .carry/peer/horovod_gpu_build.sh, a copy
#                     of ../shared/peer/horovod_gpu_build.sh, with its files in .carry/peer)
#   PEER_RESULTS      the peer's junit files (default .carry/peer-results: kept between runs,
#                     so upstream's suite runs once per machine type)
#   WHEELS            a folder of wheels to install first (default .carry/whl: mock)
# tools/carry_setup.sh fills .carry/ (upstream's tests, the wheels, the peer's files).
# Everything lands in GPU_CHECK_OUT (default /tmp/gpu_check), and, on the lent machine, in
# $OUT/<that folder's name>.tgz, refreshed every 20 s so that a run cut off still returns its logs.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
DEADLINE=${GPU_CHECK_DEADLINE:-560}
STEPS=${GPU_CHECK_STEPS:-build ours upstream}
RES=${GPU_CHECK_OUT:-/tmp/gpu_check}
export HOROVOD_UPSTREAM=${HOROVOD_UPSTREAM:-$PWD/.carry/upstream}
PEER_BUILD=${PEER_BUILD:-$PWD/.carry/peer/horovod_gpu_build.sh}
PEER_RESULTS=${PEER_RESULTS:-$PWD/.carry/peer-results}
WHEELS=${WHEELS:-$PWD/.carry/whl}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$RES"
say() { printf '[gpu_check %4ds] %s\n' "$((SECONDS - T0))" "$*" | tee -a "$RES/summary.txt"; }
# Seconds left before the deadline, never under 30 (a step past it still gets a try).
left() { local l=$((DEADLINE - (SECONDS - T0))); echo $((l > 30 ? l : 30)); }
# Upstream's suite on the GPUs into $RES/$1 (PYTHON and HOROVODRUN pick the project).
suite() {
  UPSTREAM_OUT="$RES/$1" UPSTREAM_TIMEOUT=$(( $(left) / $(echo $NPS | wc -w) )) \
    UPSTREAM_TEST_TIMEOUT=${UPSTREAM_TEST_TIMEOUT:-60} tools/upstream_tests.sh --gpu $NPS \
    | tee -a "$RES/summary.txt"
}

if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  TGZ="$OUT/$(basename "$RES").tgz"
  pack() { tar czf "$TGZ.part" -C "$(dirname "$RES")" "$(basename "$RES")" 2>/dev/null && mv "$TGZ.part" "$TGZ"; }
  (while sleep 20; do pack; done) &
  PACKER=$!
  trap 'kill $PACKER 2>/dev/null; pack' EXIT
fi

ngpu=${GPU_CHECK_NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
NPS=${GPU_CHECK_NP:-2 $([ "$ngpu" -ge 4 ] && echo 4)}
say "$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs); torch $(python3 -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())'); steps: $STEPS; NP: $NPS"
if [ -d "$WHEELS" ]; then python3 -m pip install -q --no-index --no-deps "$WHEELS"/*.whl; fi

# Our GPU tests: one pytest session, or with 4+ GPUs one per pair of GPUs side by side
# (session i on GPUs 2i and 2i+1, the tests dealt out among them).
ours() {
  local n=$((ngpu / 2)) i rc limit ids pids=() devs
  [ "$n" -ge 2 ] || n=1
  if ! python3 -m pytest --collect-only -q -p no:cacheprovider -m gpu tests/test_gpu.py \
      ${GPU_CHECK_K:+-k "$GPU_CHECK_K"} >"$RES/collect.log" 2>&1 ||
     ! grep '::' "$RES/collect.log" >"$RES/test_ids.txt"; then
    tail -20 "$RES/collect.log"; say "ours: collecting the tests FAILED (or none selected)"
    return
  fi
  say "ours: $(wc -l <"$RES/test_ids.txt") tests in $n pytest session(s)"
  limit=$(left)
  for ((i = 0; i < n; i++)); do
    awk -v n="$n" -v i="$i" 'NR % n == i' "$RES/test_ids.txt" >"$RES/test_ids.$i.txt"
    if [ ! -s "$RES/test_ids.$i.txt" ]; then echo "no tests" >"$RES/test_gpu.$i.log"; true & pids+=($!); continue; fi
    mapfile -t ids <"$RES/test_ids.$i.txt"
    devs=()
    [ "$n" -gt 1 ] && devs=(env CUDA_VISIBLE_DEVICES=$((2 * i)),$((2 * i + 1)))
    "${devs[@]}" timeout -k 10 "$limit" python3 -m pytest -v -rfE -p no:cacheprovider -m gpu \
      "${ids[@]}" --junitxml="$RES/test_gpu.$i.xml" >"$RES/test_gpu.$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < n; i++)); do
    wait "${pids[$i]}"
    rc=$?
    say "ours$([ "$n" -gt 1 ] && echo ", GPUs $((2 * i)),$((2 * i + 1))"): exit $rc -- $(tail -1 "$RES/test_gpu.$i.log")"
    grep -E '^(FAILED|ERROR)' "$RES/test_gpu.$i.log" | tee -a "$RES/summary.txt"
  done
}
BESIDE=0
if [[ " $STEPS " == *" ours "* && " $STEPS " == *" upstream "* && "$ngpu" -ge 4 ]]; then BESIDE=1; fi

for step in $STEPS; do
  case $step in
    build)
      # As `make build` does: the extension built in place and the checkout installed
      # editable, so that our tests (which import the checkout) and upstream's suite
      # (which imports the installed package) run the same build.
      say "build: setup.py build_ext --inplace, pip install -e . (log: $RES/build.log)"
      if ! { HOROVOD_TORCH_SKIP_EXT=1 python3 -m pip install --no-deps --no-build-isolation -e . &&
             MAX_JOBS=$(nproc) timeout "$(left)" python3 setup.py build_ext --inplace; } \
           >"$RES/build.log" 2>&1; then
        tail -30 "$RES/build.log"; say "build FAILED"; exit 1
      fi
      (cd /tmp && python3 -c 'import horovod_torch as h; print("built:", h.__file__, "nccl", h.nccl_built())') \
        | tee -a "$RES/summary.txt"
      ;;
    ours)
      say "ours: pytest -m gpu tests/test_gpu.py (logs: $RES/test_gpu*.log)"
      if [ "$BESIDE" = 1 ]; then
        say "upstream's suite against ours, NP $NPS, beside ours (log: $RES/upstream.txt)"
        suite ours >"$RES/upstream.txt" 2>&1 &
        UPSTREAM_PID=$!
      fi
      ours
      if [ "$BESIDE" = 1 ]; then
        wait "$UPSTREAM_PID"
        say "upstream's suite beside ours: exit $? (log: $RES/upstream.txt)"
        grep -E '^upstream_tests|rank[0-9]+: [0-9]+ passed' "$RES/upstream.txt"
      fi
      ;;
    upstream)
      if [ "$BESIDE" = 1 ]; then continue; fi
      say "upstream's suite against ours, NP $NPS"
      suite ours
      ;;
    peer)
      if (cd /tmp && /tmp/hvdpeer/bin/python -c 'import horovod.torch' 2>/dev/null); then
        say "peer: upstream already built in /tmp/hvdpeer"
      else
        say "peer: building upstream 0.28.1 (log: $RES/peer_build.log)"
        PEER_CARRY=$(dirname "$PEER_BUILD") PEER_SMOKE=0 JOBS=$(nproc) bash "$PEER_BUILD" \
          >"$RES/peer_build.log" 2>&1 || { tail -20 "$RES/peer_build.log"; say "peer build FAILED"; exit 1; }
      fi
      say "upstream's suite against upstream, NP $NPS"
      PYTHON=/tmp/hvdpeer/bin/python HOROVODRUN="/tmp/hvdpeer/bin/horovodrun --gloo" suite peer
      mkdir -p "$PEER_RESULTS" && cp "$RES"/peer/*.xml "$PEER_RESULTS"/
      ;;
    *) say "unknown step $step"; exit 2 ;;
  esac
done
if [ -d "$RES/ours" ] && ls "$PEER_RESULTS"/*.xml >/dev/null 2>&1; then
  say "ours against upstream (tests that pass there and not here, or take over twice its time):"
  python3 tools/junit_summary.py --compare "$PEER_RESULTS" "$RES/ours" | tee -a "$RES/summary.txt"
fi
say "done"
