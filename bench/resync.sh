#!/usr/bin/env bash
# bench/resync.sh -- resync throughput (issue 14): a 2 GiB 2-way mirror, filled; leg b goes missing while
# 256 MiB of 64 KiB random writes land on leg a (tracked in the resync map); then the offline map-tracked
# resync of leg b vs a full `mirror replace` of the same leg, and `cat` of leg a's data (page cache) for
# scale. Needs fio (nbd engine). Knobs: VOUCH (binary), DIR (scratch directory, removed first).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
V=${VOUCH:-$REPO/target/release/vouch}
D=${DIR:-/var/tmp/vouch-resync-bench}; rm -rf "$D"; mkdir -p "$D"
$V create $D/a --size 2G --mirror $D/b >/dev/null
$V serve $D/a --listen 127.0.0.1:10811 2>$D/s1.log & P=$!; sleep 1
fio --name=fill --ioengine=nbd --uri=nbd://127.0.0.1:10811 --rw=write --bs=1M --iodepth=8 --size=2G >/dev/null
kill $P; wait $P || true
mv $D/b $D/b-away
$V serve $D/a --listen 127.0.0.1:10811 2>$D/s2.log & P=$!; sleep 1
fio --name=away --ioengine=nbd --uri=nbd://127.0.0.1:10811 --rw=randwrite --bs=64k --iodepth=8 --size=2G --io_size=256M --randrepeat=0 --norandommap >/dev/null
kill $P; wait $P || true
mv $D/b-away $D/b
$V mirror status $D/a 2>/dev/null | tail -2 || true
for rate in 4G; do
  t0=$(date +%s.%N); $V mirror resync $D/a --leg 1 --rate $rate 2>/dev/null | tail -1; t1=$(date +%s.%N)
  echo "resync (map) took $(echo "$t1 - $t0" | bc) s"
done
$V check $D/a >/dev/null && echo "check clean"
# full copy for comparison: mark leg 1 stale via a missing-dir open, then replace (every block)
mv $D/b $D/b-away
$V serve $D/a --listen 127.0.0.1:10811 2>$D/s3.log & P=$!; sleep 1; kill $P; wait $P || true
mv $D/b-away $D/b; rm -f $D/a/mirror.dirty.1
t0=$(date +%s.%N); $V mirror replace $D/a --leg 1; t1=$(date +%s.%N)
echo "replace (full) took $(echo "$t1 - $t0" | bc) s"
t0=$(date +%s.%N); cat $D/a/data.* > /dev/null; t1=$(date +%s.%N); echo "cat of leg a's data took $(echo "$t1 - $t0" | bc) s"
