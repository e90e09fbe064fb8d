#!/usr/bin/env bash
# bench/recovery.sh -- recovery time after a crash of the vouch process, VOUCH against VOUCH_BASE.
# Each round, each binary on its own fresh SIZE volume per layout: `serve`, a fixed fio workload over
# NBD (WRITES 4 KiB random writes at QD32, the same seed for both, ending with a flush), `kill -9` of
# the server, then a new `serve` of the volume timed from its start until it listens (a writable
# open with recovery), and the recovery's own duration as the server prints it ("recovered N
# journal records in T"; a binary with the held log also puts back what it held). Rounds
# alternate which binary goes first. Output: samples in $OUT/samples.tsv and, per layout, the
# median seconds of both measures and new/base.
#   VOUCH=<new> VOUCH_BASE=<old> bench/recovery.sh
#   SIZE=2G WRITES=50000 REPS=7 LAYOUTS=split VOUCH=... VOUCH_BASE=... bench/recovery.sh
# Needs fio with its nbd engine (apt-get install -y fio). DIR (default /var/tmp/vouch-recovery-bench)
# is removed at exit.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VOUCH=${VOUCH:?VOUCH=<the vouch binary to measure>}
VOUCH_BASE=${VOUCH_BASE:?VOUCH_BASE=<the vouch binary to compare with>}
SIZE=${SIZE:-1G}
WRITES=${WRITES:-20000}
REPS=${REPS:-5}
LAYOUTS=${LAYOUTS:-"split packed"}
PORT=${PORT:-10990}
DIR=${DIR:-/var/tmp/vouch-recovery-bench}
OUT=${OUT:-$REPO/target/bench-recovery/$(date +%Y%m%d-%H%M%S)}
PID=""
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
command -v fio >/dev/null || die "fio missing: apt-get install -y fio"
fio --enghelp 2>/dev/null | grep -qx '[[:space:]]*nbd' || die "fio has no nbd engine: apt-get install -y fio"
stop() { # signal
    [ -n "$PID" ] || return 0
    kill "-$1" "$PID" 2>/dev/null
    for _ in $(seq 600); do kill -0 "$PID" 2>/dev/null || break; sleep 0.05; done
    kill -KILL "$PID" 2>/dev/null
    wait "$PID" 2>/dev/null
    PID=""
}
trap 'stop KILL; rm -rf "$DIR"' EXIT
trap 'exit 130' INT TERM HUP
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }
serve() { # binary volume log -> $PID, returns once it listens
    "$1" serve "$2" --listen "127.0.0.1:$PORT" >>"$3" 2>&1 &
    PID=$!
    for _ in $(seq 6000); do
        listening && return 0
        kill -0 "$PID" 2>/dev/null || die "serve of $2 exited: $(tail -3 "$3")"
        sleep 0.005
    done
    die "serve of $2 did not listen"
}
seconds() { # "12.3ms" / "1.2s" / "800µs" (Rust's Duration Debug) -> seconds
    awk -v d="$1" 'BEGIN {
        if (d ~ /ms$/) { sub(/ms$/, "", d); print d / 1e3 }
        else if (d ~ /µs$/) { sub(/µs$/, "", d); print d / 1e6 }
        else if (d ~ /ns$/) { sub(/ns$/, "", d); print d / 1e9 }
        else if (d ~ /s$/) { sub(/s$/, "", d); print d + 0 }
        else print "nan" }'
}
one() { # name binary layout round -> a samples row
    local name=$1 bin=$2 layout=$3 round=$4 vol=$DIR/$1-$3 logf=$OUT/logs/$1-$3.log t0 t1 line
    rm -rf "$vol"
    "$bin" create "$vol" --size "$SIZE" --layout "$layout" >>"$logf" 2>&1 || die "create $vol failed"
    serve "$bin" "$vol" "$logf"
    fio --name=crash --ioengine=nbd --uri="nbd://127.0.0.1:$PORT" --rw=randwrite --bs=4k \
        --iodepth=32 --number_ios="$WRITES" --size="$SIZE" --norandommap --randseed=28 \
        --end_fsync=1 --output=/dev/null >>"$logf" 2>&1 || die "fio into $name $layout failed"
    stop KILL
    sync
    : >"$DIR/serve.log"
    t0=$(date +%s.%N)
    serve "$bin" "$vol" "$DIR/serve.log"
    t1=$(date +%s.%N)
    stop TERM
    cat "$DIR/serve.log" >>"$logf"
    line=$(grep -o 'recovered [0-9]* journal records in [^ ]*' "$DIR/serve.log" | head -1)
    printf '%s\t%s\t%s\t%.4f\t%s\t%s\n' "$round" "$layout" "$name" \
        "$(echo "$t1 - $t0" | bc)" "$(seconds "${line##* }")" "$(echo "$line" | awk '{print $2}')" \
        >>"$OUT/samples.tsv"
    log "r$round $layout $name: open $(echo "$t1 - $t0" | bc) s; ${line:-no recovery line}"
    rm -rf "$vol"
}
mkdir -p "$OUT/logs"
rm -rf "$DIR"
mkdir -p "$DIR"
printf 'round\tlayout\tbinary\topen_s\trecovery_s\trecords\n' >"$OUT/samples.tsv"
for round in $(seq "$REPS"); do
    for layout in $LAYOUTS; do
        if [ $((round % 2)) = 1 ]; then
            one base "$VOUCH_BASE" "$layout" "$round"
            one new "$VOUCH" "$layout" "$round"
        else
            one new "$VOUCH" "$layout" "$round"
            one base "$VOUCH_BASE" "$layout" "$round"
        fi
    done
done
python3 - "$OUT/samples.tsv" "$SIZE" "$WRITES" "$REPS" >"$OUT/report.md" <<'PY'
import csv, sys, statistics as st
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print("# recovery after kill -9: %s volume, %s 4 KiB random writes QD32 then a flush, %s rounds\n"
      % (sys.argv[2], sys.argv[3], sys.argv[4]))
print("| layout | open to listening, base / new (s, median) | new/base | recovery as printed, base / new (s, median) | new/base | records replayed base / new |")
print("|---|---|---:|---|---:|---|")
for layout in dict.fromkeys(r["layout"] for r in rows):
    m = {}
    for b in ("base", "new"):
        sel = [r for r in rows if r["layout"] == layout and r["binary"] == b]
        rec = [float(r["recovery_s"]) for r in sel if r["recovery_s"] not in ("", "nan")]
        m[b] = (st.median(float(r["open_s"]) for r in sel), st.median(rec) if rec else float("nan"),
                "/".join(sorted({r["records"] or "0" for r in sel})))
    print("| %s | %.3f / %.3f | %.3f | %.4f / %.4f | %.3f | %s / %s |" % (
        layout, m["base"][0], m["new"][0], m["new"][0] / m["base"][0],
        m["base"][1], m["new"][1], m["new"][1] / m["base"][1], m["base"][2], m["new"][2]))
PY
log "report: $OUT/report.md"
cat "$OUT/report.md"
