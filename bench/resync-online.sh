#!/usr/bin/env bash
# bench/resync-online.sh -- online resync under client load (issue 14): a SIZE 2-way mirror, filled; leg b
# goes missing while AWAY of 64 KiB random writes land on leg a (tracked in its resync map); leg b comes
# back and `vouch serve` resyncs it at open with --resync-min MIN / --resync-max MAX while fio reads 4 KiB at
# random at QD1 for FG_SECONDS (FG=randwrite: writes them, so the resync must end under a write stream
# over its dirty regions). Then the same fio run on the synced mirror (no resync) for the baseline.
# Prints the resync's time and rate under load and the foreground IOPS with and without it, REPS rounds.
# Needs fio (nbd engine). Knobs: VOUCH (binary), DIR (scratch directory, removed first and at the end).
#   bench/resync-online.sh
#   MIN=10M MAX=1G AWAY=512M REPS=3 bench/resync-online.sh
#   FG=randwrite bench/resync-online.sh
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
V=${VOUCH:-$REPO/target/release/vouch}
D=${DIR:-/var/tmp/vouch-resync-online-bench}
SIZE=${SIZE:-2G}; AWAY=${AWAY:-256M}; MIN=${MIN:-20M}; MAX=${MAX:-1G}; FG_SECONDS=${FG_SECONDS:-8}; REPS=${REPS:-3}
FG=${FG:-randread}
case $FG in randread) DIRECTION=read ;; randwrite) DIRECTION=write ;; *) echo "FG is randread or randwrite" >&2; exit 1 ;; esac
PORT=10812; CONTROL=127.0.0.1:10813
command -v fio >/dev/null || { echo "fio missing: apt-get install -y fio" >&2; exit 1; }
P=""
stop() { if [ -n "$P" ]; then kill "$P" 2>/dev/null; wait "$P" 2>/dev/null || true; P=""; fi; }
trap 'stop; rm -rf "$D"' EXIT
serve() { # extra serve args
    $V serve "$D/a" --listen 127.0.0.1:$PORT "$@" >>"$D/serve.log" 2>&1 & P=$!
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && return 0; sleep 0.05; done
    echo "server did not start: $(tail -3 "$D/serve.log")" >&2; exit 1
}
reads() { # -> IOPS of FG_SECONDS of 4 KiB random reads (or FG=randwrite: writes) at QD1
    fio --name=fg --ioengine=nbd --uri=nbd://127.0.0.1:$PORT --rw="$FG" --bs=4k --iodepth=1 \
        --time_based --runtime="$FG_SECONDS" --norandommap --randrepeat=0 --output-format=json 2>/dev/null |
        python3 -c 'import json,sys; s=sys.stdin.read(); print("%.0f" % json.loads(s[s.index("{"):])["jobs"][0][sys.argv[1]]["iops"])' "$DIRECTION"
}
rm -rf "$D"; mkdir -p "$D"
$V create "$D/a" --size "$SIZE" --mirror "$D/b" >/dev/null
serve
fio --name=fill --ioengine=nbd --uri=nbd://127.0.0.1:$PORT --rw=write --bs=1M --iodepth=8 --size="$SIZE" >/dev/null
stop
echo "# online resync under load: SIZE=$SIZE AWAY=$AWAY MIN=$MIN MAX=$MAX FG=$FG FG_SECONDS=$FG_SECONDS, $(git -C "$REPO" rev-parse --short HEAD)"
printf 'round\tblocks\tresync_s\tresync_MiB_s\tfg_iops_during\tfg_iops_alone\tratio\n'
for rep in $(seq 1 "$REPS"); do
    mv "$D/b" "$D/b-away"
    serve
    fio --name=away --ioengine=nbd --uri=nbd://127.0.0.1:$PORT --rw=randwrite --bs=64k --iodepth=8 \
        --size="$SIZE" --io_size="$AWAY" --randrepeat=0 --norandommap >/dev/null
    stop
    mv "$D/b-away" "$D/b"
    serve --control "$CONTROL" --resync-min "$MIN" --resync-max "$MAX"
    during=$(reads)
    status=$($V mirror status a --server "$CONTROL" --json 2>/dev/null || true)
    row=$(echo "$status" | python3 -c '
import json, sys
legs = json.load(sys.stdin)["legs"]
r = legs[1].get("resync") or {}
print(r.get("state"), r.get("copied", 0), r.get("elapsed_ms", 0))')
    read -r state copied elapsed_ms <<< "$row"
    [ "$state" = done ] || { echo "round $rep: the resync did not finish within ${FG_SECONDS} s of $FG ($row)" >&2; exit 1; }
    alone=$(reads)
    stop
    awk -v r="$rep" -v c="$copied" -v e="$elapsed_ms" -v d="$during" -v a="$alone" 'BEGIN {
        printf "%d\t%d\t%.2f\t%.0f\t%s\t%s\t%.2f\n", r, c, e / 1000, c * 4096 / 1048576 / (e / 1000), d, a, d / a }'
done
$V check "$D/a" >/dev/null && echo "check clean (both legs)"
