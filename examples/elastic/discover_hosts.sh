#!/bin/sh
# Host discovery for the elastic example: this machine with 2 slots. Edit (or point
# HOROVOD_DISCOVERY_HOSTS at a file of host:slots lines) to add or remove hosts
# while the job runs.
if [ -n "$HOROVOD_DISCOVERY_HOSTS" ] && [ -f "$HOROVOD_DISCOVERY_HOSTS" ]; then
  cat "$HOROVOD_DISCOVERY_HOSTS"
else
  echo "localhost:2"
fi
