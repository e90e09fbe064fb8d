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
# Output: $OUT/samples.tsv (round, direction, seconds, MB/s) and the medians on stdout.
# Run it under `nice -n -10` on a quiet machine; quote the medians and say how busy the machine was.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SIZE=${SIZE:-1G}; REPS=${REPS:-3}; BUILD=${BUILD:-1}
DIR=${DIR:-/var/tmp/vouch-migrate-bench}
OUT=${OUT:-$REPO/target/bench-migrate/$(date +%Y%m%d-%H%M%S)}
VOUCH=${VOUCH:-$REPO/target/release/vouch}
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
cleanup() { rm -rf "$DIR"; }
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
