#!/bin/sh
# A stand-in for ssh, used by test_multihost.py as horovodrun's --ssh-command:
#   multihost_netns_exec.sh HOST 'SHELL COMMAND'
# runs the command with sh inside the network namespace that $MULTIHOST_NETNS_MAP
# ("10.99.0.11=ns-a 10.99.0.12=ns-b") gives for HOST, with stdin passed through.
# Each call appends HOST to $MULTIHOST_EXEC_LOG when that is set.
host=$1
shift
[ -n "$MULTIHOST_EXEC_LOG" ] && echo "$host" >> "$MULTIHOST_EXEC_LOG"
for pair in $MULTIHOST_NETNS_MAP; do
  if [ "${pair%%=*}" = "$host" ]; then
    exec ip netns exec "${pair#*=}" sh -c "$1"
  fi
done
echo "multihost_netns_exec.sh: no namespace for host $host" >&2
exit 255
