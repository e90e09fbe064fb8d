#!/bin/bash
# Snapshot create on xfs (issue 33): a SIZE volume on a sparse xfs image
# (mkfs.xfs -m reflink=1, loop device: root), SEQ bytes written
# sequentially through `vouch serve` (0 = none), then ROUNDS rounds of
# WRITES random 4 KiB writes (fio's nbd engine, QD16) each followed by
# REPS offline `vouch snapshot create`s (kept: the next round's writes
# copy-on-write the shared blocks, as a volume with a backup snapshot
# does). Prints, per round, the data and contexts files' extents and
# each create's own time (lock to last fsync) and its median.
# usage: SIZE=16G SEQ=0 WRITES=50000 ROUNDS=2 REPS=5 bench/snapshot-create.sh
#   VOUCH=target/ci/vouch  IMG=14G (the xfs image's size, sparse)
#   CREATE_ARGS="--layout packed" (extra `vouch create` arguments)
#   ONLINE=N: then N online creates (`--server`) while a QD1 4 KiB random
#   writer flushing every 8 writes runs (bench/snapshot-pause.py), on the
#   same volume: how long each held the volume (its clients' flushes)
#   HINT=1m: an xfs extent size hint on the new volume's data and contexts
#   files (xfs_io extsize) before any write, to measure what it changes
set -e
V=$(realpath "${VOUCH:-target/ci/vouch}")
SIZE=${SIZE:-16G}; SEQ=${SEQ:-0}; WRITES=${WRITES:-50000}; ROUNDS=${ROUNDS:-2}; REPS=${REPS:-5}
for tool in mkfs.xfs xfs_io fio nbdkit nbdcopy; do
    command -v $tool >/dev/null || { echo "missing $tool: apt-get install xfsprogs fio nbdkit libnbd-bin" >&2; exit 1; }
done
D=$(mktemp -d)
SP=
cleanup() {
    [ -n "$SP" ] && kill $SP 2>/dev/null && wait $SP 2>/dev/null
    umount $D/mnt 2>/dev/null; rm -rf $D
}
trap cleanup EXIT
truncate -s ${IMG:-14G} $D/fs.img; mkfs.xfs -q -m reflink=1 $D/fs.img; mkdir $D/mnt
mount -o loop $D/fs.img $D/mnt
VOL=$D/mnt/vol; SOCK=$D/s.sock
$V create $VOL --size $SIZE $CREATE_ARGS >/dev/null
[ -n "$HINT" ] && xfs_io -c "extsize $HINT" $VOL/data.00000 $VOL/contexts
serve() {
    $V serve $VOL --socket $SOCK >$D/serve.out 2>&1 & SP=$!
    for _ in $(seq 100); do [ -S $SOCK ] && break; sleep 0.1; done
}
stop() { kill -TERM $SP; wait $SP || true; SP=; rm -f $SOCK; }
extents() { # data and contexts mappings (extents, holes not counted)
    local n=
    for f in $VOL/data.00000 $VOL/contexts; do
        [ -f $f ] && n="$n $(basename $f)=$(xfs_io -r -c 'fiemap' $f | grep -vc hole)"
    done
    echo "$n"
}
if [ "$SEQ" != 0 ]; then
    serve
    nbdcopy -- [ nbdkit random size=$SEQ ] "nbd+unix:///?socket=$SOCK"
    stop
fi
for round in $(seq $ROUNDS); do
    serve
    fio --name=rw --ioengine=nbd --uri="nbd+unix:///?socket=$SOCK" --rw=randwrite --bs=4k \
        --number_ios=$WRITES --iodepth=16 --norandommap --randrepeat=0 --output=/dev/null
    stop
    sync
    echo "round $round: $WRITES random 4 KiB writes; extents:$(extents); xfs used $(df --output=used -h $D/mnt | tail -1)"
    times=()
    for rep in $(seq $REPS); do
        out=$(nice -n -10 $V snapshot create $VOL r${round}s$rep)
        times+=($(echo "$out" | grep -o '[0-9.]* ms' | cut -d' ' -f1))
    done
    median=$(printf '%s\n' "${times[@]}" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
    echo "round $round: snapshot create ms: ${times[*]}; median $median"
done
if [ -n "$ONLINE" ]; then
    $V serve $VOL --listen 127.0.0.1:0 --control 127.0.0.1:0 >$D/serve.out 2>&1 & SP=$!
    for _ in $(seq 100); do grep -q "control" $D/serve.out && grep -q "serving on" $D/serve.out && break; sleep 0.2; done
    URI=$(grep -o "nbd://[^ ]*" $D/serve.out | head -1); CTL=$(grep -o "http://[^ ]*" $D/serve.out | head -1)
    BLOCKS=$(( $(numfmt --from=iec $SIZE) / 4096 ))
    echo "online: $ONLINE creates, extents before:$(extents)"
    nice -n -10 /usr/bin/python3 "$(dirname "$0")"/snapshot-pause.py "$URI" $V "$CTL" $BLOCKS $ONLINE 8
    stop
fi
df -h $D/mnt | tail -1
