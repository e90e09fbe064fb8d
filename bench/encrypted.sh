#!/usr/bin/env bash
# bench/encrypted.sh -- encrypted vs plain vouch volumes over NBD, split and packed, in one run.
#
# Four servers, started once and kept running: plain_split, enc_split, plain_packed, enc_packed
# (fresh volumes of SIZE, each prefilled with a 1 MiB sequential write through NBD). Each test is
# fio --ioengine=nbd (numjobs=1, --norandommap, whole export): 4 KiB random read and write at QD32,
# 1 MiB sequential read and write at QD8, RUNTIME seconds each. Interleaved: for rep: for test: for
# server (rotated each rep), so a pair is measured seconds apart. report.md has per-server medians and
# the encrypted/plain ratio per layout and test (issue 13's targets: >= 0.85 on 4 KiB random,
# >= 0.7 on 1 MiB sequential).
#
# Env: VOUCH (binary, default target/release/vouch), DIR (scratch, default a temp dir),
#      SIZE (default 1GiB), RUNTIME (default 10), REPS (default 3), OUT (default DIR/out).
set -euo pipefail
cd "$(dirname "$0")/.."
VOUCH=${VOUCH:-$PWD/target/release/vouch}
DIR=${DIR:-$(mktemp -d /tmp/vouch-enc-bench.XXXXXX)}
SIZE=${SIZE:-1GiB}
RUNTIME=${RUNTIME:-10}
REPS=${REPS:-3}
OUT=${OUT:-$DIR/out}
for tool in fio python3; do
    command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install -y fio python3" >&2; exit 2; }
done
[ -x "$VOUCH" ] || { echo "no vouch binary at $VOUCH: cargo build --release -p vouch" >&2; exit 2; }
mkdir -p "$OUT/fio" "$OUT/logs"
head -c 32 /dev/urandom > "$DIR/key"
SERVERS=(plain_split enc_split plain_packed enc_packed)
declare -A PORT PID
port=20810
cleanup() { for s in "${SERVERS[@]}"; do [ -n "${PID[$s]:-}" ] && kill "${PID[$s]}" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT
for s in "${SERVERS[@]}"; do
    layout=${s#*_}
    extra=()
    [[ $s == enc_* ]] && extra=(--encrypt --key-file "$DIR/key")
    PORT[$s]=$port
    "$VOUCH" serve "$DIR/vol-$s" --create "$SIZE" --layout "$layout" "${extra[@]}" \
        --listen "127.0.0.1:$port" --log warn > "$OUT/logs/$s.out" 2> "$OUT/logs/$s.log" &
    PID[$s]=$!
    port=$((port + 1))
done
for s in "${SERVERS[@]}"; do
    for _ in $(seq 100); do grep -q "serving on" "$OUT/logs/$s.out" 2>/dev/null && break; sleep 0.1; done
    grep -q "serving on" "$OUT/logs/$s.out" || { echo "$s did not start:" >&2; cat "$OUT/logs/$s.log" >&2; exit 2; }
done
run_fio() { # server test rw bs qd runtime
    local s=$1 test=$2 rw=$3 bs=$4 qd=$5 rt=$6
    fio --name="$test" --ioengine=nbd --uri="nbd://127.0.0.1:${PORT[$s]}" --rw="$rw" --bs="$bs" \
        --iodepth="$qd" --numjobs=1 --norandommap --randrepeat=0 --time_based --runtime="$rt" \
        --output-format=json --output="$OUT/fio/$s-$test-$7.json" >/dev/null
}
for s in "${SERVERS[@]}"; do
    echo "prefill $s" >&2
    fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:${PORT[$s]}" --rw=write --bs=1M --iodepth=8 \
        --numjobs=1 --output-format=json --output="$OUT/fio/$s-prefill.json" >/dev/null
done
TESTS=("rr4k_qd32 randread 4k 32" "rw4k_qd32 randwrite 4k 32" "sr1m_qd8 read 1M 8" "sw1m_qd8 write 1M 8")
for rep in $(seq "$REPS"); do
    for t in "${TESTS[@]}"; do
        read -r test rw bs qd <<< "$t"
        n=${#SERVERS[@]}
        for i in $(seq 0 $((n - 1))); do
            s=${SERVERS[$(((i + rep) % n))]}
            echo "rep $rep $test $s" >&2
            run_fio "$s" "$test" "$rw" "$bs" "$qd" "$RUNTIME" "$rep"
        done
    done
done
python3 - "$OUT" "${SERVERS[@]}" > "$OUT/report.md" <<'PY'
import json, os, statistics, sys
out, servers = sys.argv[1], sys.argv[2:]
tests = ["rr4k_qd32", "rw4k_qd32", "sr1m_qd8", "sw1m_qd8"]
def value(path, test):
    job = json.load(open(path))["jobs"][0]
    side = job["read"] if test.startswith(("rr", "sr")) else job["write"]
    return side["iops"] if "4k" in test else side["bw_bytes"] / 1e6
med = {}
for s in servers:
    for t in tests:
        vals = [value(os.path.join(out, "fio", f), t) for f in sorted(os.listdir(os.path.join(out, "fio")))
                if f.startswith(f"{s}-{t}-")]
        med[s, t] = (statistics.median(vals), min(vals), max(vals), len(vals))
print("| test | unit | " + " | ".join(servers) + " | enc/plain split | enc/plain packed |")
print("|---|---|" + "---|" * (len(servers) + 2))
for t in tests:
    unit = "IOPS" if "4k" in t else "MB/s"
    cells = [f"{med[s, t][0]:.0f} ({med[s, t][1]:.0f}-{med[s, t][2]:.0f})" for s in servers]
    ratios = [med[f"enc_{l}", t][0] / med[f"plain_{l}", t][0] for l in ("split", "packed")]
    print(f"| {t} | {unit} | " + " | ".join(cells) + " | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
print(f"\nmedian (min-max) of {med[servers[0], tests[0]][3]} repetitions; fio --ioengine=nbd numjobs=1, whole export")
PY
cat "$OUT/report.md"
