#!/usr/bin/env bash
# bench/import.sh -- image import (issue 11): `nbdcopy` of a SIZE image of random data into a
# fresh export (with FLUSH=1, the default, `nbdcopy --flush`: the copy ends when the data is durable,
# so the disk's write-back speed dominates; FLUSH=0 times what the server ingests), vouch (split and packed, page cache) vs qemu-nbd --cache=writeback vs nbdkit's file
# plugin, each target new for every copy (a fresh vouch volume; a fresh sparse raw file for the
# anchors), servers alternating within each round (in a new order every round).
#
# Output: $OUT/samples.tsv and $OUT/report.md (median seconds, MB/s, ratios to each anchor).
# Needs nbdcopy (libnbd-bin), qemu-nbd (qemu-utils), nbdkit; builds target/release/vouch unless BUILD=0.
#   bench/import.sh
#   SIZE=4G REPS=5 SERVERS="vouch_split nbdkit_pc" bench/import.sh
#   FLUSH=0 REPS=5 bench/import.sh
#   VOUCH_BASE=<another vouch> SERVERS="vouch_split base_split nbdkit_pc" FLUSH=0 bench/import.sh  (A/B)
#   HOLD_REPORTING=0 bench/import.sh   (leave the guest's free page reporting as it is: see below)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SIZE=${SIZE:-2G}; REPS=${REPS:-3}; BUILD=${BUILD:-1}; FLUSH=${FLUSH:-1}
SERVERS=${SERVERS:-"vouch_split vouch_packed qemunbd_wb nbdkit_pc"}
DIR=${DIR:-/var/tmp/vouch-import-bench}
OUT=${OUT:-$REPO/target/bench-import/$(date +%Y%m%d-%H%M%S)}
VOUCH=${VOUCH:-$REPO/target/release/vouch}
VOUCH_BASE=${VOUCH_BASE:-}  # base_split / base_packed: the same servers from this binary
PORT=${PORT:-10970}
HOLD_REPORTING=${HOLD_REPORTING:-1}
PID=""
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
for tool in nbdcopy:libnbd-bin qemu-nbd:qemu-utils nbdkit:nbdkit; do
    command -v "${tool%%:*}" >/dev/null || die "${tool%%:*} missing: apt-get install -y ${tool#*:}"
done

stop_server() {
    [ -n "$PID" ] || return 0
    kill -TERM "$PID" 2>/dev/null
    for _ in $(seq 600); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$PID" 2>/dev/null; PID=""
}
# In a VM whose kernel reports free memory to the host (virtio-balloon free page reporting:
# /sys/module/page_reporting), every page a server touches for the first time since it was freed
# and reported costs the host a fault; which server gets reported pages depends on what ran before,
# and the same copy into fresh page cache measured 0.21-1.06 s of CPU per GiB from run to run here
# (0.22-0.24 s with reporting held). Most of that was in long writes (the page cache's large folios
# come from the reported blocks): vouch writes at most 256 KiB per call since, and paid far less
# (bench/first-touch.sh WRITE=256K); HOLD_REPORTING=0 measures the guest as it comes. With HOLD_REPORTING=1 (the default, where the knob exists and is
# writable) the run raises page_reporting_order past the largest free block, so nothing freed during
# the run is handed back, touches 2 x SIZE once before the first round, and restores the order at exit.
REPORTING=/sys/module/page_reporting/parameters/page_reporting_order
REPORTING_WAS=""
hold_reporting() {
    [ "$HOLD_REPORTING" = 1 ] && [ -w "$REPORTING" ] || return 0
    REPORTING_WAS=$(cat "$REPORTING")
    echo 11 > "$REPORTING" || { REPORTING_WAS=""; return 0; }
    log "free page reporting held (page_reporting_order $REPORTING_WAS -> 11) for the run"
    fio --name=warm --directory="$DIR" --size="$SIZE" --rw=write --bs=1M --numjobs=2 \
        --output=/dev/null > /dev/null 2>&1
    rm -f "$DIR"/warm*; sync
}
cleanup() {
    stop_server; rm -rf "$DIR"
    if [ -n "$REPORTING_WAS" ]; then echo "$REPORTING_WAS" > "$REPORTING"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

start_server() { # NAME -> a fresh target on $PORT
    local s=$1 target=$DIR/target-$1
    rm -rf "$target"
    case $s in
    vouch_split|vouch_packed|base_split|base_packed)
        local bin=$VOUCH
        if [ "${s%%_*}" = base ]; then
            [ -n "$VOUCH_BASE" ] || die "$s needs VOUCH_BASE=<a vouch binary>"
            bin=$VOUCH_BASE
        fi
        "$bin" serve "$target" --create "$SIZE" --layout "${s#*_}" --listen "127.0.0.1:$PORT" \
            >> "$OUT/logs/$s.log" 2>&1 &
        PID=$! ;;
    qemunbd_wb)
        truncate -s "$SIZE" "$target"
        qemu-nbd -f raw -t -e 8 --cache=writeback --aio=threads -b 127.0.0.1 -p "$PORT" \
            --pid-file="$DIR/qemu.pid" --fork "$target" 2>> "$OUT/logs/$s.log" || die "qemu-nbd failed"
        PID=$(cat "$DIR/qemu.pid") ;;
    nbdkit_pc)
        truncate -s "$SIZE" "$target"
        nbdkit -P "$DIR/nbdkit.pid" -i 127.0.0.1 -p "$PORT" file file="$target" 2>> "$OUT/logs/$s.log" \
            || die "nbdkit failed"
        for _ in $(seq 50); do [ -s "$DIR/nbdkit.pid" ] && break; sleep 0.1; done
        PID=$(cat "$DIR/nbdkit.pid") ;;
    *) die "unknown server $s" ;;
    esac
    for _ in $(seq 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && return 0; sleep 0.1
    done
    die "$s did not listen on $PORT"
}

# Each copy starts from the same state of the disk: the previous target's 2 GiB is deleted, and on a
# filesystem mounted with `discard` (as here) ext4 sends those discards at its next journal commit, so
# whichever server ran next waited behind them (the same binary measured 3.98 s in one slot and 2.32 s
# in the one after it). settle writes back and trims before the next server starts.
MNT=$(findmnt -no TARGET -T "${DIR%/*}" 2>/dev/null || echo /)
settle() {
    sync
    fstrim "$MNT" 2>/dev/null || true
    sync
    cat "$SRC" > /dev/null  # the source stays in the page cache for every copy
}

if [ "$BUILD" = 1 ]; then
    (cd "$REPO" && cargo build --release -q -p vouch) || die "cargo build failed"
fi
mkdir -p "$OUT/logs"; rm -rf "$DIR"; mkdir -p "$DIR"
SRC=$DIR/source.img
log "source: $SIZE of random data in $SRC"
fio --name=src --filename="$SRC" --size="$SIZE" --rw=write --bs=1M --refill_buffers --output=/dev/null \
    > /dev/null 2>&1 || die "making the source failed"
hold_reporting
settle
TSV=$OUT/samples.tsv
printf 'rep\tserver\tseconds\n' > "$TSV"
read -ra SRV <<< "$SERVERS"
for rep in $(seq 1 "$REPS"); do
    # A new order each round, the same for a given round in every run: a rotation would have each
    # server always follow the same one, and what a copy leaves behind (freed page cache the host
    # takes back, discards) then always lands on the same server.
    mapfile -t order < <(printf '%s\n' "${SRV[@]}" | shuf --random-source=<(yes "$rep"))
    for s in "${order[@]}"; do
        start_server "$s"
        sync
        t0=$(date +%s.%N)
        flush=(); [ "$FLUSH" = 1 ] && flush=(--flush)
        nbdcopy "${flush[@]}" "$SRC" "nbd://127.0.0.1:$PORT" 2>> "$OUT/logs/$s.log" || die "nbdcopy into $s failed"
        t1=$(date +%s.%N)
        stop_server
        secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.3f", b-a}')
        printf '%s\t%s\t%s\n' "$rep" "$s" "$secs" >> "$TSV"
        log "r$rep $s: $secs s"
        rm -rf "$DIR/target-$s"
        settle
    done
done

python3 - "$TSV" "$SIZE" "$SERVERS" "$FLUSH" > "$OUT/report.md" <<'PY'
import csv, sys, statistics as st
from collections import defaultdict
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
size = sys.argv[2]
nbytes = int(size[:-1]) * units[size[-1].upper()] if size[-1].upper() in units else int(size)
servers = sys.argv[3].split()
t = defaultdict(dict)
for r in rows:
    t[r["server"]][r["rep"]] = float(r["seconds"])
print("# image import: nbdcopy%s of %s into a fresh export (bench/import.sh, FLUSH=%s)\n" % (
    " --flush" if sys.argv[4] == "1" else "", size, sys.argv[4]))
anchors = [a for a in ("qemunbd_wb", "nbdkit_pc") if a in t]
print("| server | seconds (median) | MB/s | per round | " + " | ".join("vs %s (median of per-round speed ratios)" % a for a in anchors) + " |")
print("|---|---:|---:|---|" + "---:|" * len(anchors))
for s in servers:
    if s not in t:
        continue
    med = st.median(t[s].values())
    cells = []
    for a in anchors:
        ratios = [t[a][k] / t[s][k] for k in t[s] if k in t[a]]
        cells.append("%.2f" % st.median(ratios))
    print("| %s | %.2f | %.0f | %s | %s |" % (s, med, nbytes / med / 1e6,
          " ".join("%.2f" % t[s][k] for k in sorted(t[s])), " | ".join(cells)))
PY
log "report: $OUT/report.md"
cat "$OUT/report.md"
