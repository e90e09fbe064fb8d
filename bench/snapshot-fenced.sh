#!/bin/bash
# Fenced online snapshot create on xfs (issue 33, stop 41): a SIZE volume
# on a sparse xfs image (loop device: root), WRITES random 4 KiB writes
# (fio's nbd engine, QD16) so its files have that many extents, then REPS
# online creates with "wait": false through the control API while it is
# served: each answer's time (curl's, and the server's total_ms / held_ms)
# and how long the materialisation took until `list` showed it done. Then
# the foreground cost: fio 4 KiB random writes QD32 for SECS seconds with
# no snapshot materialising, and started right after a create's answer
# (ROUNDS pairs, one run each, same server): each rate, the ratio of the
# medians, and how long each of those materialisations took under the load
# (a run longer than it was armed only in part: the script says so).
# STRACE=1 also counts, with strace -c -f on the server, the before log's
# fdatasync/pwrite64 calls and the futex waits per foreground write, one
# run unarmed and one armed (slowed by strace: counts, not rates).
# usage: SIZE=16G WRITES=50000 REPS=5 SECS=3 ROUNDS=3 bench/snapshot-fenced.sh
#   VOUCH=target/ci/vouch  IMG=14G  PORT=12782 (control port)  SCRATCH=/var/tmp/cow33-bench
set -e
V=$(realpath "${VOUCH:-target/ci/vouch}")
SIZE=${SIZE:-16G}; WRITES=${WRITES:-50000}; REPS=${REPS:-5}; SECS=${SECS:-3}; ROUNDS=${ROUNDS:-3}; PORT=${PORT:-12782}
for tool in mkfs.xfs xfs_io fio curl; do
    command -v $tool >/dev/null || { echo "missing $tool: apt-get install xfsprogs fio curl" >&2; exit 1; }
done
D=$(mktemp -d ${SCRATCH:-/var/tmp/cow33-bench}.XXXX)
SP=
cleanup() {
    [ -n "$SP" ] && kill $SP 2>/dev/null && wait $SP 2>/dev/null
    umount $D/mnt 2>/dev/null; rm -rf $D
}
trap cleanup EXIT
truncate -s ${IMG:-14G} $D/fs.img; mkfs.xfs -q -m reflink=1 $D/fs.img; mkdir $D/mnt
mount -o loop $D/fs.img $D/mnt
VOL=$D/mnt/vol; SOCK=$D/s.sock; CTL=http://127.0.0.1:$PORT
$V create $VOL --size $SIZE >/dev/null
$V serve $VOL --socket $SOCK --control 127.0.0.1:$PORT >$D/serve.out 2>&1 & SP=$!
for _ in $(seq 100); do [ -S $SOCK ] && curl -s $CTL/v1/exports >/dev/null && break; sleep 0.2; done
URI="nbd+unix:///?socket=$SOCK"
fio --name=rw --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k \
    --number_ios=$WRITES --iodepth=16 --norandommap --randrepeat=0 --output=/dev/null
sync
echo "$WRITES random 4 KiB writes; extents: data $(xfs_io -r -c fiemap $VOL/data.00000 | grep -vc hole), contexts $(xfs_io -r -c fiemap $VOL/contexts | grep -vc hole)"
materialised() {
    local start=$(date +%s.%N)
    while curl -s $CTL/v1/exports/vol/snapshots | grep -q '"materialising": *true'; do sleep 0.01; done
    echo "$(date +%s.%N) - $start" | bc
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
answers=(); totals=(); helds=(); mats=()
for rep in $(seq $REPS); do
    out=$(nice -n -10 curl -s -w ' %{time_total}' -X POST -H 'Content-Type: application/json' \
        -d "{\"name\": \"f$rep\", \"wait\": false}" $CTL/v1/exports/vol/snapshots)
    answers+=($(echo "$out" | awk '{print $NF * 1000}'))
    totals+=($(echo "$out" | grep -o '"total_ms":[0-9.]*' | cut -d: -f2))
    helds+=($(echo "$out" | grep -o '"held_ms":[0-9.]*' | cut -d: -f2))
    mats+=($(materialised))
done
echo "create answered (curl) ms: ${answers[*]}; median $(median ${answers[@]})"
echo "server total_ms: ${totals[*]}; median $(median ${totals[@]})"
echo "held at the flush point ms: ${helds[*]}; median $(median ${helds[@]})"
echo "materialised after the answer s: ${mats[*]}; median $(median ${mats[@]})"
rw() { fio --name=rw --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth=32 \
    --time_based --runtime=$SECS --norandommap --randrepeat=0 --output-format=terse --terse-version=3 2>/dev/null | grep '^3;' | cut -d';' -f49; }
snap() { curl -s -o /dev/null -X POST -H 'Content-Type: application/json' \
    -d "{\"name\": \"$1\", \"wait\": false}" $CTL/v1/exports/vol/snapshots; }
quiet=(); during=(); took=()
for rep in $(seq $ROUNDS); do
    quiet+=($(rw))
    start=$(date +%s.%N)
    snap w$rep
    during+=($(rw))
    materialised >/dev/null
    took+=($(echo "$(date +%s.%N) - $start" | bc))
done
echo "rw4k_qd32 IOPS, nothing materialising: ${quiet[*]}; median $(median ${quiet[@]})"
echo "rw4k_qd32 IOPS, started at a create's answer: ${during[*]}; median $(median ${during[@]})"
echo "armed / unarmed (medians): $(echo "scale=3; $(median ${during[@]}) / $(median ${quiet[@]})" | bc)"
echo "materialised under that load after s: ${took[*]}; median $(median ${took[@]})"
for t in ${took[@]}; do
    [ "$(echo "$t < $SECS" | bc)" = 1 ] && echo "note: a materialisation ($t s) ended before its ${SECS} s run: armed for part of it only"
done
if [ -n "$STRACE" ]; then
    command -v strace >/dev/null || { echo "missing strace: apt-get install strace" >&2; exit 1; }
    count() { # $1 label: strace the server for one run; calls per foreground write
        strace -c -f -p $SP -e trace=fdatasync,fsync,pwrite64,pwritev,futex -o $D/strace.$1 & local ST=$!
        sleep 0.5
        local iops=$(rw)
        kill -INT $ST; wait $ST 2>/dev/null || true
        local ios=$(echo "$iops * $SECS" | bc)
        echo "strace $1: ~$ios foreground writes ($iops IOPS under strace)"
        awk -v n=$ios '$NF ~ /^(fdatasync|fsync|pwrite64|pwritev|futex)$/ {c=($5 ~ /^[0-9]+$/ ? $4 : $4); printf "  %-10s calls %8d  per write %.3f  seconds %s\n", $NF, $4, $4 / n, $2}' $D/strace.$1
    }
    count unarmed
    snap s1
    count armed
    materialised >/dev/null
fi
kill -TERM $SP; wait $SP || true; SP=
df -h $D/mnt | tail -1
grep -h "before-image layer did" $D/serve.out | sed 's/.*snapshot /snapshot /' || true
