#!/usr/bin/env bash
# bench/reconcile.sh -- a mirror's reconciliation after an exporter crash under a write stream (issue 31),
# and mirror write throughput against another binary (main's), local 2-way mirrors of SIZE.
#
# 1. Crash: a fresh 2-way mirror of SIZE, fio random 64 KiB writes at QD8 over the whole volume for
#    WRITE_SECONDS (a flush every 256 writes), `kill -9` of the exporter mid-stream; restarted with the
#    control API and --resync-max RECONCILE_MAX, `mirror status --server --json` is polled until the
#    reconciliation is done: regions (4 MiB extents) the activity log named, blocks checked and copied,
#    its own elapsed time. Then an offline `vouch scrub` must find 0 differences.
# 2. Throughput: for VOUCH and VOUCH_B (if given), a fresh 2-way mirror per binary, prefilled with a
#    sequential write; fio rw4k_qd32 (random 4 KiB writes, QD32) and sw1m_qd8 (sequential 1 MiB writes, QD8)
#    for RUNTIME s, REPS rounds, binaries interleaved in each round. Medians and B/A ratios.
# Output: $OUT/report.md, $OUT/samples.tsv. Needs fio (its nbd engine) and python3.
#   SIZE=1G REPS=3 RUNTIME=5 VOUCH_B=/tmp/vouch-main bench/reconcile.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SIZE=${SIZE:-1G}; RUNTIME=${RUNTIME:-5}; REPS=${REPS:-3}; WRITE_SECONDS=${WRITE_SECONDS:-5}
RECONCILE_MAX=${RECONCILE_MAX:-2G}
DIR=${DIR:-/var/tmp/vouch-reconcile-bench}
OUT=${OUT:-$REPO/target/bench-reconcile/$(date +%Y%m%d-%H%M%S)}
VOUCH=${VOUCH:-$REPO/target/release/vouch}
VOUCH_B=${VOUCH_B:-}
PORT=10950; CONTROL=10951
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
command -v fio >/dev/null || die "fio missing: apt-get install -y fio"
[ -x "$VOUCH" ] || die "$VOUCH missing: cargo build --release -p vouch"
SERVER=
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT
mkdir -p "$OUT"

serve() { # BINARY LEG0 EXTRA...: start a server, wait for its port
    local bin=$1 leg=$2; shift 2
    "$bin" serve "$leg" --listen 127.0.0.1:$PORT "$@" >"$OUT/serve.out" 2>>"$OUT/serve.log" &
    SERVER=$!
    for _ in $(seq 200); do
        grep -q "serving on" "$OUT/serve.out" 2>/dev/null && return 0
        sleep 0.05
    done
    die "server did not start: $(tail -5 "$OUT/serve.log")"
}
stop() { kill "$SERVER"; wait "$SERVER" 2>/dev/null; SERVER=; }
fresh() { # BINARY: a fresh 2-way mirror in $DIR
    rm -rf "$DIR"; mkdir -p "$DIR"
    "$1" create "$DIR/a" --size "$SIZE" --mirror "$DIR/b" >/dev/null || die "create"
}
fio_run() { # NAME RW BS QD SECONDS [extra]: prints write MiB/s
    local name=$1 rw=$2 bs=$3 qd=$4 secs=$5; shift 5
    fio --name="$name" --ioengine=nbd --uri=nbd://127.0.0.1:$PORT --rw="$rw" --bs="$bs" --iodepth="$qd" \
        --size="$SIZE" --time_based --runtime="$secs" --output-format=json "$@" 2>/dev/null |
        python3 -c 'import json,sys; t=sys.stdin.read(); d=json.loads(t[t.index("{"):]); print(round(d["jobs"][0]["write"]["bw_bytes"]/1048576,1))'
}

# 1. Crash and reconciliation.
fresh "$VOUCH"
serve "$VOUCH" "$DIR/a"
fio --name=stream --ioengine=nbd --uri=nbd://127.0.0.1:$PORT --rw=randwrite --bs=64k --iodepth=8 \
    --size="$SIZE" --fsync=256 --time_based --runtime=$((WRITE_SECONDS * 4)) >/dev/null 2>&1 &
FIO=$!
sleep "$WRITE_SECONDS"
kill -9 "$SERVER"; wait "$SERVER" 2>/dev/null; SERVER=
wait "$FIO" 2>/dev/null
serve "$VOUCH" "$DIR/a" --control 127.0.0.1:$CONTROL --resync-max "$RECONCILE_MAX"
for _ in $(seq 1200); do
    "$VOUCH" mirror status a --server http://127.0.0.1:$CONTROL --json >"$OUT/status.json" 2>/dev/null
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["legs"][1]["reconcile"]; sys.exit(0 if r and r["state"]!="running" else 1)' \
        "$OUT/status.json" && break
    sleep 0.1
done
stop
"$VOUCH" scrub "$DIR/a" --json >"$OUT/scrub.json" || log "scrub exited non-zero"
python3 - "$OUT/status.json" "$OUT/scrub.json" "$SIZE" >"$OUT/report.md" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["legs"][1]["reconcile"]
s = json.load(open(sys.argv[2]))
print(f"## Reconciliation after kill -9 under random 64 KiB writes, 2-way local mirror of {sys.argv[3]}\n")
print("| regions (4 MiB) | blocks checked | blocks copied | seconds | scrub afterwards: found | corrected |")
print("|---|---|---|---|---|---|")
corrected = sum(leg.get("corrected", 0) for leg in s["legs"])
print(f"| {r['regions']} | {r['blocks_checked']} | {r['blocks_copied']} | {r['elapsed_ms']/1000:.2f} | {s['report']['found']} | {corrected} |")
PY

# 2. Throughput, binaries interleaved.
BINS=("$VOUCH"); [ -n "$VOUCH_B" ] && BINS+=("$VOUCH_B")
printf 'round\tbinary\ttest\tMiBps\n' >"$OUT/samples.tsv"
for round in $(seq "$REPS"); do
    for bin in "${BINS[@]}"; do
        fresh "$bin"
        serve "$bin" "$DIR/a"
        fio_run fill write 1M 8 2 >/dev/null
        printf '%s\t%s\trw4k_qd32\t%s\n' "$round" "$bin" "$(fio_run rw randwrite 4k 32 "$RUNTIME")" >>"$OUT/samples.tsv"
        printf '%s\t%s\tsw1m_qd8\t%s\n' "$round" "$bin" "$(fio_run sw write 1M 8 "$RUNTIME")" >>"$OUT/samples.tsv"
        stop
        log "round $round $(basename "$bin") done"
    done
done
python3 - "$OUT/samples.tsv" "$VOUCH" "$VOUCH_B" >>"$OUT/report.md" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
a, b = sys.argv[2], sys.argv[3]
print("\n## Mirror write throughput (MiB/s, medians)\n")
print(f"| test | A ({a}) | B ({b or '-'}) | A/B |")
print("|---|---|---|---|")
for test in ("rw4k_qd32", "sw1m_qd8"):
    med = lambda bin: statistics.median(float(r["MiBps"]) for r in rows if r["binary"] == bin and r["test"] == test)
    ma = med(a)
    mb = med(b) if b else None
    print(f"| {test} | {ma:.1f} | {mb if mb is None else f'{mb:.1f}'} | {'-' if not mb else f'{ma/mb:.3f}'} |")
PY
cat "$OUT/report.md"
