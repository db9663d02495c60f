#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages a part of the work needs, if missing:
#   tools/system-deps.sh build   what building the package and running the demo need: a
#                                C++ compiler, make, Python's headers (python3-dev), and
#                                python3-venv where python3 cannot create a virtual
#                                environment (the Makefile installs everything Python,
#                                ninja included, into .venv)
#   tools/system-deps.sh [test]  that, and what the tests need: GoogleTest (C++ tests);
#                                clang and clang-format (the thread-safety analysis of the
#                                lock annotations and the style check, make cpp-check);
#                                OpenMPI (the MPI controller and its tests); openssh-server
#                                and iproute2 (the multi-host tests with network
#                                namespaces); a Java runtime (pyspark, for the Spark
#                                integration's tests)
# Needs root (or sudo); without it, prints what is missing and goes on.
set -euo pipefail
what=${1:-test}
case $what in build|test) ;; *) echo "usage: $0 [build|test]" >&2; exit 2 ;; esac
need=""
command -v g++ >/dev/null || need="$need g++"
command -v make >/dev/null || need="$need make"
python3 -c "import ensurepip, venv" 2>/dev/null || need="$need python3-venv"
# Python.h, which the extension compiles against (absent from a bare Debian python3).
python3 -c 'import os, sysconfig; os.stat(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
  2>/dev/null || need="$need python3-dev"
if [ "$what" = test ]; then
  [ -f /usr/include/gtest/gtest.h ] || need="$need libgtest-dev"
  command -v ninja >/dev/null || need="$need ninja-build"
  command -v clang++ >/dev/null || need="$need clang"
  command -v clang-format >/dev/null || need="$need clang-format"
  command -v mpicxx >/dev/null || need="$need libopenmpi-dev openmpi-bin"
  [ -x /usr/sbin/sshd ] || need="$need openssh-server openssh-client"
  command -v ip >/dev/null || need="$need iproute2"
  command -v java >/dev/null || need="$need openjdk-17-jre-headless"
fi
[ -z "$need" ] && exit 0
if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
  echo "system-deps: missing$need; install them as root (apt-get install$need)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq $need
