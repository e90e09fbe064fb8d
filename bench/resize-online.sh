#!/bin/bash
# Online grow (issue 33): a QD1 4 KiB random writer over NBD (a flush every
# FLUSH_EVERY writes) while `vouch resize --server` grows a FROM volume to
# TO, REPS times (a new volume each). Prints one JSON line per run.
# MIGRATE=packed: a volume with regions (every region moved to packed by
# `vouch migrate` before it is served). PORT / CTL_PORT: the NBD and
# control ports (0: any).
# usage: FROM=1T TO=4T REPS=3 [MIGRATE=packed] bench/resize-online.sh FLUSH_EVERY
set -e
V=${VOUCH:-target/ci/vouch}
for rep in $(seq ${REPS:-3}); do
  D=$(mktemp -d)
  $V create $D/vol --size ${FROM:-1T} >/dev/null
  [ -n "$MIGRATE" ] && $V migrate $D/vol --layout $MIGRATE >/dev/null
  nice -n -10 $V serve $D/vol --listen 127.0.0.1:${PORT:-0} --control 127.0.0.1:${CTL_PORT:-0} > $D/out 2>$D/err & SP=$!
  for i in $(seq 50); do grep -q "control" $D/out 2>/dev/null && grep -q "serving on" $D/out && break; sleep 0.2; done
  URI=$(grep -o "nbd://[^ ]*" $D/out | head -1); CTL=$(grep -o "http://[^ ]*" $D/out | head -1)
  BLOCKS=$(( $($V info $D/vol --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["size_bytes"])') / 4096 ))
  nice -n -10 /usr/bin/python3 "$(dirname "$0")"/resize-online.py "$URI" $V "$CTL" $BLOCKS ${TO:-4T} "${1:-8}" || true
  kill $SP; wait $SP || true
  rm -rf $D
done
