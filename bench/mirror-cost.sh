#!/bin/bash
# bench/mirror-cost.sh BIN TAG MODE N -- the cost of N client writes to a local 2-way mirror, counted
# in ways a busy machine does not skew (the "costs nothing" check of a mirror write-path change).
#
# A fresh 1 GiB (SIZE) mirror (vol + vol-leg1, as bench/nbd.sh's vouch_mirror2) is served by BIN,
# prefilled (fio seq 1M QD8 over NBD) and warmed (2 s of the workload); then N requests of fio
# --ioengine=nbd RW (randwrite) BS (4k) at QD (32) are counted by MODE:
#   callgrind  the server restarted under valgrind --tool=callgrind, counters zeroed just before the
#              N requests and dumped after: OUT/TAG.callgrind.1 holds the instructions (Ir) of exactly
#              those requests, all threads; `callgrind_annotate OUT/TAG.callgrind.1 | grep TOTALS`
#   dhat       the server restarted under valgrind --tool=dhat (allocations: OUT/TAG.serve.log)
#   stat       perf stat -e task-clock,context-switches,... -p SERVER around the N requests (OUT/TAG.stat)
#   record     perf record -g -p SERVER around them (OUT/TAG.perf)
#   strace     strace -c -f -p SERVER around them (OUT/TAG.strace)
# MIRROR=0 serves a single volume instead (LAYOUT=split|packed, the layout of the volume or legs):
# the same counts for the engine's own write routes. REMOTE=1 makes leg 1 a replica on 127.0.0.1:RPORT
# (`BIN replica serve --insecure`, never under valgrind): the mirror's completion path; callgrind then
# counts the exporter only (its `try_start_write` and the replica connection's reader thread).
# MPORT (PORT+100) is the metrics port.
# Every line of OUT/summary.txt gives the requests answered inline (the nbd metrics) before and after.
# Example (stop 40, admit30b): for b in /work/bin/vouch-s39b target/release/vouch; do
#   bench/mirror-cost.sh $b $(basename $b) callgrind 20000; done
# Needs valgrind, perf, strace, fio, nbdinfo, curl (apt-get install valgrind linux-perf strace fio
# libnbd-bin curl).
set -u
BIN=$1 TAG=$2 MODE=$3 N=$4
QD=${QD:-32} RW=${RW:-randwrite} BS=${BS:-4k} SIZE=${SIZE:-1G}
PORT=${PORT:-12650} MPORT=${MPORT:-$((PORT+100))} RPORT=${RPORT:-$((PORT+200))}
MIRROR=${MIRROR:-1} LAYOUT=${LAYOUT:-split} REMOTE=${REMOTE:-0}
OUT=${OUT:-/var/tmp/mirror-cost}; mkdir -p "$OUT"
for tool in fio nbdinfo curl valgrind perf strace; do
    command -v $tool >/dev/null || { echo "missing $tool: apt-get install valgrind linux-perf strace fio libnbd-bin curl"; exit 1; }
done
d=$(mktemp -d /var/tmp/mirror-cost-XXXX)
spid="" rpid=""
trap '[ -n "$spid" ] && kill $spid 2>/dev/null; [ -n "$rpid" ] && kill $rpid 2>/dev/null; wait 2>/dev/null; rm -rf "$d"' EXIT
mirror=(); [ "$MIRROR" = 1 ] && mirror=(--mirror "$d/vol-leg1")
if [ "$REMOTE" = 1 ]; then
    mkdir -p "$d/replicas"
    "$BIN" replica serve "$d/replicas" --listen 127.0.0.1:$RPORT --insecure > "$OUT/$TAG.replica.log" 2>&1 &
    rpid=$!
    sleep 1
    mirror=(--mirror "vouch://127.0.0.1:$RPORT/r")
fi
"$BIN" create "$d/vol" --size "$SIZE" --layout "$LAYOUT" "${mirror[@]}" > "$d/create.log" 2>&1 || { cat "$d/create.log"; exit 1; }
serve() {
    "$@" serve "$d/vol" --listen 127.0.0.1:$PORT --metrics 127.0.0.1:$MPORT > "$OUT/$TAG.serve.log" 2>&1 &
    spid=$!
    for _ in $(seq 600); do nbdinfo --size nbd://127.0.0.1:$PORT >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "serve did not start: $OUT/$TAG.serve.log"; exit 1
}
counts() { # requests inline-requests, summed over the export
    curl -s "http://127.0.0.1:$MPORT/metrics" | awk -v c="${RW#rand}" '
        index($1, "vouch_nbd_requests_total{command=\"" c "\",") == 1 { r += $2 }
        index($1, "vouch_nbd_inline_requests_total{command=\"" c "\",") == 1 { i += $2 }
        END { print r + 0, i + 0 }'
}
workload() { fio --ioengine=nbd --uri=nbd://127.0.0.1:$PORT --rw="$RW" --bs="$BS" --iodepth="$QD" \
    --norandommap --randrepeat=0 "$@"; }
serve "$BIN"
fio --name=prefill --ioengine=nbd --uri=nbd://127.0.0.1:$PORT --rw=write --bs=1M --iodepth=8 \
    --size="$SIZE" > /dev/null 2>&1 || { echo "prefill failed"; exit 1; }
workload --name=warm --time_based --runtime=2 > /dev/null 2>&1
case $MODE in
    callgrind|dhat)
        kill $spid; wait $spid
        case $MODE in
            callgrind) serve valgrind --tool=callgrind --callgrind-out-file="$OUT/$TAG.callgrind" "$BIN" ;;
            dhat) serve valgrind --tool=dhat --dhat-out-file="$OUT/$TAG.dhat" "$BIN" ;;
        esac
        workload --name=warm --number_ios=2000 > /dev/null 2>&1 ;;
    stat|record|strace) ;;
    *) echo "unknown MODE $MODE"; exit 1 ;;
esac
sync
c0=$(counts)
mpid=""
case $MODE in
    stat) perf stat -e task-clock,context-switches,cpu-migrations,page-faults -p $spid -o "$OUT/$TAG.stat" & mpid=$! ;;
    record) perf record -g -F 2000 -p $spid -o "$OUT/$TAG.perf" > /dev/null 2>&1 & mpid=$! ;;
    strace) strace -c -f -p $spid -o "$OUT/$TAG.strace" & mpid=$! ;;
    callgrind) callgrind_control -z $spid > /dev/null ;;
esac
sleep 0.5
t0=$(date +%s.%N)
workload --name=measured --number_ios="$N" --output-format=json --output="$OUT/$TAG.fio.json" > /dev/null 2>&1
t1=$(date +%s.%N)
c1=$(counts)
case $MODE in
    stat|record|strace) kill -INT $mpid; wait $mpid ;;
    callgrind) callgrind_control -d $spid > /dev/null ;;
esac
echo "$TAG $MODE $LAYOUT mirror=$MIRROR remote=$REMOTE $RW $BS QD$QD N=$N wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}')s requests,inline before [$c0] after [$c1]" \
    | tee -a "$OUT/summary.txt"
