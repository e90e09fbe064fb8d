#!/usr/bin/env bash
# bench/packed.sh -- the packed layout's reason to exist (issue 11): random reads of 1 .. 1024 blocks at
# QD1 and QD8 on split and packed volumes whose contexts do not fit in vouch's context cache, with
# `serve --direct` (data from the device, not the page cache), measured side by side in one run.
#
# The Crucible RFD measured packed contexts 1.08-1.42x faster on random reads because a read is one I/O
# instead of two. vouch's split layout keeps context pages in a cache (`serve --context-cache`, 64 MiB
# by default = every context of an 8 GiB volume), so that case exists only when the working set's
# contexts miss it. Here every test starts cold: the server is restarted (its context cache empty) and
# the volume's files are dropped from the page cache (fsync + POSIX_FADV_DONTNEED), so a split read
# that misses the cache reads its context page from the device, as on a volume too large for memory.
#
# Volumes: SIZE each (default 16G: 128 MiB of contexts against CACHE=16M of context cache, so at most
# 1/8 of the context pages are ever cached), filled through NBD with one sequential 1 MiB write pass
# of fio's random buffers. Reads: fio --ioengine=nbd randread over the whole volume, BLOCKS (4 KiB
# blocks per read) x QDS, RUNTIME s each, REPS rounds, split and packed alternating in each round
# (the order flips every round).
#
# Output: $OUT/samples.tsv, $OUT/report.md (medians, packed/split ratios, server CPU per read).
# Needs fio; builds target/release/vouch unless BUILD=0. Disk: about 2 x SIZE in DIR.
#   bench/packed.sh
#   SIZE=8G CACHE=4M BLOCKS="1 8 64" QDS="1" REPS=5 bench/packed.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SIZE=${SIZE:-16G}; CACHE=${CACHE:-16M}; RUNTIME=${RUNTIME:-5}; REPS=${REPS:-3}; BUILD=${BUILD:-1}
BLOCKS=${BLOCKS:-"1 4 16 64 256 1024"}; QDS=${QDS:-"1 8"}
DIR=${DIR:-/var/tmp/vouch-packed-bench}
OUT=${OUT:-$REPO/target/bench-packed/$(date +%Y%m%d-%H%M%S)}
VOUCH=${VOUCH:-$REPO/target/release/vouch}
PORT_BASE=${PORT_BASE:-10960}
declare -A PORT=([split]=$PORT_BASE [packed]=$((PORT_BASE + 1)))
PID=""
HZ=$(getconf CLK_TCK)
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
command -v fio >/dev/null || die "fio missing: apt-get install -y fio"

stop_server() {
    [ -n "$PID" ] || return 0
    kill -TERM "$PID" 2>/dev/null
    for _ in $(seq 600); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; PID=""
}
cleanup() { stop_server; rm -rf "$DIR"; }
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

start_server() { # LAYOUT
    local port=${PORT[$1]}
    "$VOUCH" serve "$DIR/$1" --direct --context-cache "$CACHE" --listen "127.0.0.1:$port" \
        >> "$OUT/logs/$1.log" 2>&1 &
    PID=$!
    for _ in $(seq 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0; sleep 0.1
    done
    die "$1 did not listen on $port: $(tail -5 "$OUT/logs/$1.log")"
}
evict() { # DIR: every file of a stopped volume out of the page cache
    python3 - "$1" <<'PY'
import os, sys
for name in os.listdir(sys.argv[1]):
    fd = os.open(os.path.join(sys.argv[1], name), os.O_RDONLY)
    os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
PY
}
proc_ticks() { local s; s=$(cat "/proc/$1/stat" 2>/dev/null) || { echo 0; return; }; s=${s##*) }; set -- $s; echo $(( ${12} + ${13} )); }

if [ "$BUILD" = 1 ]; then
    (cd "$REPO" && cargo build --release -q -p vouch) || die "cargo build failed"
fi
mkdir -p "$OUT/logs" "$OUT/fio"; rm -rf "$DIR"; mkdir -p "$DIR"
TSV=$OUT/samples.tsv
printf 'rep\tlayout\tblocks\tqd\tiops\tmbps\tclat_us\tserver_us_per_read\n' > "$TSV"
{
    echo "# packed vs split, cold contexts (bench/packed.sh)"
    echo
    echo "- command: \`SIZE=$SIZE CACHE=$CACHE RUNTIME=$RUNTIME REPS=$REPS BLOCKS=\"$BLOCKS\" QDS=\"$QDS\" bench/packed.sh\`"
    echo "- date: $(date -Iseconds); vouch $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null); $(nproc) CPUs"
    echo "- directory: $DIR on $(df --output=fstype "$DIR" | tail -1) ($(df --output=source "$DIR" | tail -1))"
} > "$OUT/facts.md"

for layout in split packed; do
    "$VOUCH" create "$DIR/$layout" --size "$SIZE" --layout "$layout" > "$OUT/logs/$layout.log" 2>&1 \
        || die "create $layout: $(cat "$OUT/logs/$layout.log")"
    start_server "$layout"
    log "$layout: filling $SIZE (sequential 1 MiB writes through NBD)"
    t0=$(date +%s.%N)
    fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:${PORT[$layout]}" --rw=write --bs=1M \
        --iodepth=8 --output="$OUT/logs/$layout-fill.txt" > /dev/null 2>&1 || die "fill $layout failed"
    log "$layout: filled in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"
    stop_server
done

for rep in $(seq 1 "$REPS"); do
    order="split packed"; (( rep % 2 == 0 )) && order="packed split"
    for blocks in $BLOCKS; do
        for qd in $QDS; do
            for layout in $order; do
                evict "$DIR/$layout"
                start_server "$layout"
                json=$OUT/fio/$layout-${blocks}b-qd$qd-r$rep.json
                p0=$(proc_ticks "$PID")
                fio --output-format=json --output="$json" --name=r --ioengine=nbd \
                    --uri="nbd://127.0.0.1:${PORT[$layout]}" --rw=randread --bs=$((blocks * 4))k \
                    --iodepth="$qd" --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 \
                    > "$OUT/logs/fio.stdout" 2>&1 || log "fio $layout ${blocks}b qd$qd failed"
                p1=$(proc_ticks "$PID")
                stop_server
                row=$(python3 - "$json" $((p1 - p0)) "$HZ" <<'PY'
import json, sys
s = open(sys.argv[1]).read()
d = json.loads(s[s.index('{'):])["jobs"][0]["read"]
n = max(d["total_ios"], 1)
print("%.1f\t%.2f\t%.1f\t%.1f" % (d["iops"], d["bw_bytes"] / 1e6, d["clat_ns"]["mean"] / 1e3,
      int(sys.argv[2]) / int(sys.argv[3]) * 1e6 / n))
PY
) || row="0	0	0	0"
                printf '%s\t%s\t%s\t%s\t%s\n' "$rep" "$layout" "$blocks" "$qd" "$row" >> "$TSV"
                log "r$rep $layout ${blocks}x4k qd$qd: $(echo "$row" | awk -F'\t' '{printf "%s IOPS, %s MB/s, clat %s us, server %s us/read", $1, $2, $3, $4}')"
            done
        done
    done
done

python3 - "$TSV" "$OUT/facts.md" > "$OUT/report.md" <<'PY'
import csv, sys, statistics as st
from collections import defaultdict
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print(open(sys.argv[2]).read())
print("Medians of every round; each test starts with the server restarted and the volume evicted from the page cache.\n")
print("| read | QD | split IOPS | packed IOPS | packed / split (median of per-round ratios) | per round | split / packed server µs per read |")
print("|---|---:|---:|---:|---:|---|---|")
by = defaultdict(dict)
for r in rows:
    by[(int(r["blocks"]), int(r["qd"]))].setdefault(r["layout"], {})[r["rep"]] = r
for (blocks, qd) in sorted(by):
    d = by[(blocks, qd)]
    s, p = d.get("split", {}), d.get("packed", {})
    reps = sorted(set(s) & set(p))
    ratios = [float(p[k]["iops"]) / float(s[k]["iops"]) for k in reps if float(s[k]["iops"]) > 0]
    med = lambda side, col: st.median(float(v[col]) for v in side.values()) if side else float("nan")
    print("| %d KiB (%d blocks) | %d | %.0f | %.0f | %.2f | %s | %.0f / %.0f |" % (
        blocks * 4, blocks, qd, med(s, "iops"), med(p, "iops"), st.median(ratios) if ratios else float("nan"),
        " ".join("%.2f" % x for x in ratios), med(s, "server_us_per_read"), med(p, "server_us_per_read")))
PY
log "report: $OUT/report.md"
cat "$OUT/report.md"
