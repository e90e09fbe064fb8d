#!/usr/bin/env bash
# bench/commit-cost.sh -- what commits cost a stream of writes without flushes: a fresh SIZE split
# volume served by BIN, fio 4 KiB random writes at QD (no flushes) for SECS over NBD, then the
# engine's counters from `--metrics`: client bytes, journal / data / context bytes per client byte,
# commits, checkpoints, syncs. One line out. (Stop 37: prompt commits, docs/BENCHMARKS.md.)
#   bench/commit-cost.sh BIN QD [SECS]
#   for b in <old> <new>; do for qd in 1 32; do bench/commit-cost.sh $b $qd 8; done; done
# Knobs: SIZE (1G), PORT (12977; the metrics on PORT+1), DIR (a mktemp -d under /var/tmp, removed).
# Needs fio with its nbd engine and curl (apt-get install -y fio curl).
set -uo pipefail
BIN=${1:?BIN QD [SECS]} QD=${2:?BIN QD [SECS]} SECS=${3:-8}
SIZE=${SIZE:-1G} PORT=${PORT:-12977}
command -v fio >/dev/null || { echo "fio missing: apt-get install -y fio" >&2; exit 1; }
command -v curl >/dev/null || { echo "curl missing: apt-get install -y curl" >&2; exit 1; }
D=$(mktemp -d /var/tmp/commit-cost.XXXX)
"$BIN" serve --create "$SIZE" "$D/vol" --listen "127.0.0.1:$PORT" --metrics "127.0.0.1:$((PORT + 1))" >"$D/log" 2>&1 &
P=$!
trap 'kill -9 $P 2>/dev/null; wait $P 2>/dev/null; rm -rf "$D"' EXIT
for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.1; done
fio --name=w --ioengine=nbd --uri="nbd://127.0.0.1:$PORT" --rw=randwrite --bs=4k --iodepth="$QD" --numjobs=1 \
    --time_based --runtime="$SECS" --norandommap --randrepeat=0 >"$D/fio" 2>&1 || { cat "$D/fio" >&2; exit 1; }
curl -s "http://127.0.0.1:$((PORT + 1))/metrics" |
    grep -E "^vouch_engine_(client|journal|data|context)_written_bytes_total|^vouch_engine_(commits|checkpoints|syncs)_total" |
    sed 's/{[^}]*}//' |
    awk -v b="$(basename "$BIN")" -v qd="$QD" -v secs="$SECS" '{v[$1]=$2} END {
        c = v["vouch_engine_client_written_bytes_total"]
        printf "%s qd%s iops=%.0f client=%.0fMB journal/client=%.4f data/client=%.4f ctx/client=%.4f commits=%d checkpoints=%d syncs=%d\n",
            b, qd, c / 4096 / secs, c / 1e6, v["vouch_engine_journal_written_bytes_total"] / c,
            v["vouch_engine_data_written_bytes_total"] / c, v["vouch_engine_context_written_bytes_total"] / c,
            v["vouch_engine_commits_total"], v["vouch_engine_checkpoints_total"], v["vouch_engine_syncs_total"] }'
