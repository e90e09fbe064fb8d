#!/bin/bash
# Online snapshot pause (issue 33): a QD1 4 KiB random writer over NBD
# (a flush every FLUSH_EVERY writes, 0 = none) while N snapshots are taken
# through the control API, on xfs on a loop device (root). Prints JSON.
# SERVE_ARGS: more `vouch serve` flags (e.g. --migratable: a volume with
# regions, both members held at each flush point).
# usage: SIZE=256M BLOCKS=65536 N=6 [SERVE_ARGS=--migratable] bench/snapshot-pause.sh FLUSH_EVERY
set -e
V=${VOUCH:-target/ci/vouch}
D=$(mktemp -d); trap 'kill $SP 2>/dev/null; wait $SP; umount $D/mnt 2>/dev/null; rm -rf $D' EXIT
truncate -s 4G $D/fs.img; mkfs.xfs -q $D/fs.img; mkdir $D/mnt; mount -o loop $D/fs.img $D/mnt
head -c ${SIZE:-1G} /dev/urandom > $D/mnt/raw
$V import $D/mnt/raw $D/mnt/vol >/dev/null; rm $D/mnt/raw
nice -n -10 $V serve $D/mnt/vol ${SERVE_ARGS} --listen 127.0.0.1:0 --control 127.0.0.1:0 > $D/out 2>$D/err & SP=$!
for i in $(seq 50); do grep -q "control" $D/out 2>/dev/null && grep -q "serving on" $D/out && break; sleep 0.2; done
URI=$(grep -o "nbd://[^ ]*" $D/out | head -1); CTL=$(grep -o "http://[^ ]*" $D/out | head -1)
nice -n -10 /usr/bin/python3 "$(dirname "$0")"/snapshot-pause.py "$URI" $V "$CTL" ${BLOCKS:-262144} ${N:-20} "$1"
