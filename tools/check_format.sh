#!/usr/bin/env bash
# The C++ style (.clang-format) checked over csrc/, tests/cpp/ and bench/*.cc: prints
# the files clang-format would change and exits 1 if there is one. Fix them with
#   clang-format -i <files>
# Needs clang-format (tools/system-deps.sh installs it); exits 0 with a note without it.
set -euo pipefail
cd "$(dirname "$0")/.."
CF=${CLANG_FORMAT:-clang-format}
if ! command -v "$CF" >/dev/null; then
  echo "format check: $CF not found (apt-get install clang-format); not run" >&2
  exit 0
fi
files=$(ls csrc/*/*.cc csrc/*/*.h tests/cpp/*.cc tests/cpp/*.h bench/*.cc)
bad=""
for f in $files; do
  "$CF" --style=file --dry-run -Werror "$f" >/dev/null 2>&1 || bad="$bad $f"
done
if [ -n "$bad" ]; then
  echo "format check: these files do not follow .clang-format:$bad" >&2
  echo "  fix: $CF -i$bad" >&2
  exit 1
fi
echo "format check: $(echo $files | wc -w) files follow .clang-format"
