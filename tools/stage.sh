#!/usr/bin/env bash
# One line per set-up stage; the stage's own output goes to a log file.
#
#   tools/stage.sh LOG "what this stage does" command [args...]
#
# Prints "what this stage does ... done (12 s)" when the command succeeds. When it
# fails, prints "failed", the last 40 lines of LOG and where the whole log is, and
# exits with the command's status. VERBOSE=1 shows the command's output as it runs.
set -uo pipefail
log=$1 label=$2
shift 2
printf '%s ... ' "$label"
start=$SECONDS
{ echo; echo "=== $label: $*"; } >>"$log"
if [ "${VERBOSE:-0}" = 1 ]; then
  echo
  "$@" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
else
  "$@" >>"$log" 2>&1
  status=$?
fi
if [ "$status" = 0 ]; then
  echo "done ($((SECONDS - start)) s)"
  exit 0
fi
echo "failed (exit $status)"
tail -n 40 "$log" | sed 's/^/  | /'
echo "The whole log: $log (VERBOSE=1 make ... shows it as it runs)"
exit "$status"
