#!/usr/bin/env bash
# bench/migrate.sh -- offline migration throughput (issue 33): `vouch migrate` of a SIZE volume
# written with random data (imported from a raw image: every block data), split -> packed, then
# packed -> split, REPS rounds, each on a fresh import. MB/s = SIZE / the migration's wall time
# (including its final close: both members flushed and checkpointed). Median of the rounds.
#
#   bench/migrate.sh
#   SIZE=4G REPS=5 bench/migrate.sh
#   VOUCH=/other/vouch BUILD=0 bench/migrate.sh
#
# Online (ONLINE=1, the default): the same volume served (`serve --migratable --control`) and
# migrated through `vouch migrate --server` with no client (online MB/s); then fio 4 KiB random
# reads, QD32, over NBD for FIO_SECONDS without a migration, during one paced at RATE (default
# 100M: its ceiling; it yields to the reads, at most 16 MiB/s while they arrive), and without
# again: read IOPS during / the mean of the two without, per round (issue 33's target >= 0.7x;
# the two windows around it make a busy machine's drift within a round count less).
#
# Output: $OUT/samples.tsv (round, direction, seconds, MB/s), $OUT/online.tsv (round, direction,
# seconds, MB/s), $OUT/reads.tsv (round, iops without, iops during, ratio) and the medians on stdout.
# Run it under `nice -n -10` on a quiet machine; quote the medians and say how busy the machine was.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SIZE=${SIZE:-1G}; REPS=${REPS:-3}; BUILD=${BUILD:-1}; ONLINE=${ONLINE:-1}
RATE=${RATE:-100M}; FIO_SECONDS=${FIO_SECONDS:-10}
NBD_PORT=${NBD_PORT:-10933}; CONTROL_PORT=${CONTROL_PORT:-10934}
DIR=${DIR:-/var/tmp/vouch-migrate-bench}
OUT=${OUT:-$REPO/target/bench-migrate/$(date +%Y%m%d-%H%M%S)}
VOUCH=${VOUCH:-$REPO/target/release/vouch}
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
SERVER=
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2> /dev/null && wait "$SERVER"; rm -rf "$DIR"; }
trap cleanup EXIT
if [ "$BUILD" = 1 ]; then
    (cd "$REPO" && cargo build --release -p vouch -q) || die "build failed"
fi
[ -x "$VOUCH" ] || die "no vouch binary at $VOUCH"
rm -rf "$DIR"; mkdir -p "$DIR" "$OUT"
bytes=$(numfmt --from=iec "${SIZE%B}")
head -c "$bytes" /dev/urandom > "$DIR/raw" || die "cannot make the image"
printf 'round\tdirection\tseconds\tMBps\n' > "$OUT/samples.tsv"
for round in $(seq "$REPS"); do
    rm -rf "$DIR/vol"
    "$VOUCH" import "$DIR/raw" "$DIR/vol" > /dev/null || die "import failed"
    sync
    for layout in packed split; do
        start=$(date +%s.%N)
        "$VOUCH" migrate "$DIR/vol" --layout "$layout" > /dev/null 2>&1 || die "migrate to $layout failed"
        end=$(date +%s.%N)
        secs=$(echo "$end - $start" | bc -l)
        mbps=$(echo "$bytes / 1000000 / $secs" | bc -l)
        printf '%s\tto-%s\t%.3f\t%.1f\n' "$round" "$layout" "$secs" "$mbps" >> "$OUT/samples.tsv"
        log "round $round to $layout: ${secs}s"
    done
done
"$VOUCH" check "$DIR/vol" > /dev/null || die "check after the rounds failed"
for direction in to-packed to-split; do
    median=$(awk -v d="$direction" -F'\t' '$2 == d { print $4 }' "$OUT/samples.tsv" | sort -n |
        awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
    echo "migrate $SIZE $direction: median ${median} MB/s over $REPS rounds"
done
echo "samples: $OUT/samples.tsv"
[ "$ONLINE" = 1 ] || exit 0
command -v fio > /dev/null || die "no fio (apt-get install -y fio)"
median() { sort -n | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
control=127.0.0.1:$CONTROL_PORT
serve() {
    "$VOUCH" serve "$DIR/vol" --name vol --listen "127.0.0.1:$NBD_PORT" --control "$control" --migratable \
        > "$OUT/serve.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 100); do grep -q "control on" "$OUT/serve.log" && return; sleep 0.1; done
    die "the server did not start: $(cat "$OUT/serve.log")"
}
stop() { kill "$SERVER"; wait "$SERVER"; SERVER=; }
# fio's read IOPS over FIO_SECONDS (4 KiB random, QD32).
reads() {
    fio --name=reads --ioengine=nbd --uri="nbd://127.0.0.1:$NBD_PORT/vol" --rw=randread --bs=4k \
        --iodepth=32 --time_based --runtime="$FIO_SECONDS" --output-format=json 2> /dev/null |
        # fio's nbd engine prints "fio: connected to NBD server" before the JSON.
        python3 -c 'import json, sys; t = sys.stdin.read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))'
}
printf 'round\tdirection\tseconds\tMBps\n' > "$OUT/online.tsv"
printf 'round\tiops_without\tiops_during\tratio\tiops_without_after\n' > "$OUT/reads.tsv"
for round in $(seq "$REPS"); do
    rm -rf "$DIR/vol"
    "$VOUCH" import "$DIR/raw" "$DIR/vol" > /dev/null || die "import failed"
    sync
    serve
    for layout in packed split; do
        start=$(date +%s.%N)
        "$VOUCH" migrate --server "$control" vol --layout "$layout" > /dev/null 2>&1 ||
            die "online migrate to $layout failed"
        end=$(date +%s.%N)
        secs=$(echo "$end - $start" | bc -l)
        mbps=$(echo "$bytes / 1000000 / $secs" | bc -l)
        printf '%s\tto-%s\t%.3f\t%.1f\n' "$round" "$layout" "$secs" "$mbps" >> "$OUT/online.tsv"
        log "round $round online to $layout: ${secs}s"
    done
    without=$(reads)
    "$VOUCH" migrate --server "$control" vol --layout packed --rate "$RATE" > /dev/null 2>&1 &
    migrating=$!
    sleep 1
    during=$(reads)
    "$VOUCH" migrate --server "$control" vol --stop > /dev/null 2>&1
    wait "$migrating"
    after=$(reads)
    ratio=$(echo "2 * $during / ($without + $after)" | bc -l)
    printf '%s\t%s\t%s\t%.3f\t%s\n' "$round" "$without" "$during" "$ratio" "$after" >> "$OUT/reads.tsv"
    log "round $round reads: ${without} IOPS without, ${during} during, ${after} without after (ratio $ratio)"
    stop
done
for direction in to-packed to-split; do
    m=$(awk -v d="$direction" -F'\t' '$2 == d { print $4 }' "$OUT/online.tsv" | median)
    echo "migrate $SIZE online $direction: median ${m} MB/s over $REPS rounds"
done
echo "4 KiB random reads QD32 during an online migration at $RATE / without: median $(awk -F'\t' 'NR > 1 { print $4 }' "$OUT/reads.tsv" | median)x" \
    "(IOPS without $(awk -F'\t' 'NR > 1 { print $2 }' "$OUT/reads.tsv" | median), during $(awk -F'\t' 'NR > 1 { print $3 }' "$OUT/reads.tsv" | median))"
echo "samples: $OUT/online.tsv $OUT/reads.tsv"
