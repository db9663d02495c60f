#!/usr/bin/env bash
# Fills the ignored folder .carry/ that the GPU routines take to the lent machine
# (tools/gpu_check.sh, bench/gpu_tables.sh; the device tool's `carry`), which has no
# package index: upstream Horovod's tests, the test wheels for the machine's Python, and
# the files of the upstream peer build. Nothing of upstream's enters the repository.
#
#   HOROVOD_MIRROR=/path/to/horovod.git tools/carry_setup.sh [upstream] [whl] [peer]
#
#   upstream  .carry/upstream/test: upstream's test/ (HOROVOD_MIRROR: a bare git mirror of
#             github.com/horovod/horovod, whose HEAD's test/ is taken, or a work tree,
#             whose test/ is copied as it is)
#   whl       .carry/whl: mock, cloudpickle, pytest (with its dependencies), packaging,
#             pytest-timeout, psutil, as wheels for PY_VERSION (default 3.12) on x86_64
#   peer      .carry/peer: PEER_SCRIPT (default ../shared/peer/horovod_gpu_build.sh) and
#             the files its header lists (the horovod 0.28.1 sdist, the build wheels)
# Default: all three, each replacing its folder. CARRY (default .carry) is the folder.
set -euo pipefail
abs() { [ -z "$1" ] || (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }
# Paths given relative to where the script was called, then the repository root.
HOROVOD_MIRROR=$(abs "${HOROVOD_MIRROR:-}")
PEER_SCRIPT=$(abs "${PEER_SCRIPT:-}")
CARRY=$(abs "${CARRY:-}")
cd "$(dirname "$0")/.."
CARRY=${CARRY:-$PWD/.carry}
PY_VERSION=${PY_VERSION:-3.12}
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux_2_28_x86_64)
wheels() {  # wheels DIR PACKAGE...: binary wheels for the lent machine's Python
  local dir=$1; shift
  python3 -m pip download -q -d "$dir" --only-binary=:all: --python-version "$PY_VERSION" \
    "${PLATFORMS[@]}" "$@"
}
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(upstream whl peer)
for step in "${steps[@]}"; do
  case $step in
    upstream)
      : "${HOROVOD_MIRROR:?set HOROVOD_MIRROR to a horovod/horovod git mirror or work tree}"
      rm -rf "$CARRY/upstream" && mkdir -p "$CARRY/upstream"
      if [ -d "$HOROVOD_MIRROR/test/parallel" ]; then
        cp -r "$HOROVOD_MIRROR/test" "$CARRY/upstream/"
      else
        git --git-dir "$HOROVOD_MIRROR" archive HEAD test | tar -x -C "$CARRY/upstream"
      fi
      ;;
    whl)
      rm -rf "$CARRY/whl" && mkdir -p "$CARRY/whl"
      wheels "$CARRY/whl" mock cloudpickle pytest packaging pytest-timeout psutil
      ;;
    peer)
      script=${PEER_SCRIPT:-../shared/peer/horovod_gpu_build.sh}
      rm -rf "$CARRY/peer" && mkdir -p "$CARRY/peer"
      cp "$script" "$CARRY/peer/"
      python3 -m pip download -q -d "$CARRY/peer" --no-deps --no-binary=:all: horovod==0.28.1
      wheels "$CARRY/peer" --no-deps cmake==4.4.5 ninja setuptools wheel packaging psutil \
        pyyaml cloudpickle pip
      ;;
    *) echo "carry_setup: unknown part $step (upstream, whl, peer)" >&2; exit 2 ;;
  esac
  echo "carry_setup: $step -> $CARRY/$step ($(du -sh "$CARRY/$step" | cut -f1))"
done
echo "carry_setup: $CARRY holds $(du -sh "$CARRY" | cut -f1) (the device tool carries at most 64 MiB)"
