#!/usr/bin/env bash
# bench/remote.sh -- mirrors with remote legs (replicas on other "hosts": network namespaces joined by
# veth pairs) vs a single volume and vs local mirrors, all in one run (issue 14), then the resync of a
# remote leg across the link.
#
# Topology (made here, removed on exit; addresses exist only inside these namespaces):
#   vrb-e   the exporters (vouch serve) and the client (fio --ioengine=nbd to 127.0.0.1 inside vrb-e)
#   vrb-r1  `vouch replica serve DIR/r1 --listen 10.233.1.1:7101 --insecure`, veth vrb1e <-> vrb1r
#   vrb-r2  the same at 10.233.2.1:7102 (the third leg of remote3)
# The link is a veth pair (memory speed) unless LINK shapes it, e.g. LINK="rate 10gbit burst 4mb latency
# 10ms" (tc tbf on both ends) and/or NETEM="delay 100us" (tc netem: a round trip of 2x that). The
# replicas' files are on the same filesystem as the exporter's (one disk: only the network is separate).
#
# Servers (each serves a fresh split volume of SIZE, prefilled with a sequential 1M write through NBD):
#   single   vouch serve of one volume          local2, local3   local 2-/3-way mirrors (legs in DIR)
#   remote2  local leg + the replica in vrb-r1  remote3          local leg + vrb-r1 + vrb-r2
# Workloads: TESTS (default: 4 KiB randread/randwrite QD1/QD32, 1 MiB seq read/write QD8), RUNTIME s each,
# REPS rounds; each round runs every test on every server, servers rotated between rounds.
# Then CRASH (CRASH=1, the default, with remote2 in SERVERS): fio random 64 KiB writes at QD8 over the whole
# volume (a flush every 256) to remote2 for CRASH_SECONDS, `kill -9` of its exporter mid-stream, a restart with
# the control API and --resync-max RECONCILE_MAX, and `mirror status --server --json` polled until leg 1 (the
# replica) is active again: regions (4 MiB extents) the activity log named, blocks checked and copied, the
# reconciliation's own time and the time from the restart to in sync; then an offline scrub must find 0
# differences and count 0 corrected errors (SCRUB=0 skips it).
# Then RESYNC: after a flush, the replica of remote2 is SIGKILLed, RESYNC_WRITE of 64 KiB random writes land on the
# local leg (tracked in the resync map), the replica comes back, the exporter stops, and an offline
# `vouch mirror resync` copies the map across the link: blocks, seconds, MiB/s. RESYNC_WRITE=0 skips it.
#
# A/B in one run: VOUCH_B=OTHER_BINARY adds servers named SERVER_b (e.g. SERVERS="single remote2 remote2_b"):
# the same volume layout, exported by that binary on the port of SERVER + 10, its remote legs on replica
# servers of that binary (a second pair in vrb-r1/vrb-r2, ports 7111/7112). Replica CPU counts both pairs.
# The report then has a column SERVER/SERVER_b (IOPS ratio, per round medians).
#
# Output: $OUT/samples.tsv, $OUT/report.md (medians, ratios to single, exporter and replica CPU per I/O),
# $OUT/switches.tsv (per run: I/Os and the exporter's context switches, all its threads).
# Needs root (ip netns, tc) and fio; builds target/release/vouch unless BUILD=0.
#   SIZE=1G REPS=3 RUNTIME=5 bench/remote.sh
#   LINK="rate 10gbit burst 4mb latency 10ms" NETEM="delay 50us" bench/remote.sh
#   Issue 31's numbers (reconciliation of a 1 GiB mirror, mirror write throughput A/B against main's binary):
#   SIZE=1G REPS=3 RUNTIME=5 SERVERS="remote2 remote2_b" TESTS="rw4k_qd32 sw1m_qd8" VOUCH_B=/tmp/vouch-main \
#     RESYNC_WRITE=0 bench/remote.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SIZE=${SIZE:-1G}; RUNTIME=${RUNTIME:-5}; REPS=${REPS:-3}; BUILD=${BUILD:-1}
SERVERS=${SERVERS:-"single local2 local3 remote2 remote3"}
TESTS=${TESTS:-"rr4k_qd1 rr4k_qd32 rw4k_qd1 rw4k_qd32 sr1m_qd8 sw1m_qd8"}
LINK=${LINK:-}; NETEM=${NETEM:-}; RESYNC_WRITE=${RESYNC_WRITE:-256M}
CRASH=${CRASH:-1}; CRASH_SECONDS=${CRASH_SECONDS:-5}; RECONCILE_MAX=${RECONCILE_MAX:-2G}; SCRUB=${SCRUB:-1}
CONTROL_PORT=10960
DIR=${DIR:-/var/tmp/vouch-remote-bench}
OUT=${OUT:-$REPO/target/bench-remote/$(date +%Y%m%d-%H%M%S)}
VOUCH=${VOUCH:-$REPO/target/release/vouch}
VOUCH_B=${VOUCH_B:-}
NS_E=vrb-e; NS_R=(vrb-r1 vrb-r2)
declare -A PORT=([single]=10900 [local2]=10901 [local3]=10902 [remote2]=10903 [remote3]=10904)
declare -A PID=() RPID=()
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }
[ "$(id -u)" -eq 0 ] || die "bench/remote.sh needs root (ip netns, tc)"
command -v fio >/dev/null || die "fio missing: apt-get install -y fio"
for s in $SERVERS; do
    if [[ $s == *_b ]]; then
        [ -n "$VOUCH_B" ] || die "server $s needs VOUCH_B"
        [ -n "${PORT[${s%_b}]:-}" ] || die "unknown server $s"
        PORT[$s]=$((PORT[${s%_b}] + 10))
    fi
    [ -n "${PORT[$s]:-}" ] || die "unknown server $s"
done
in_e() { ip netns exec $NS_E "$@"; }

cleanup() {
    local p
    for p in "${PID[@]}" "${RPID[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for p in "${PID[@]}" "${RPID[@]}"; do
        for _ in $(seq 300); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null
    done
    for ns in $NS_E "${NS_R[@]}"; do ip netns del "$ns" 2>/dev/null; done
    rm -rf "$DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

if [ "$BUILD" = 1 ]; then
    (cd "$REPO" && cargo build --release -q -p vouch) || die "cargo build failed"
fi
mkdir -p "$OUT/logs"; rm -rf "$DIR"; mkdir -p "$DIR"
for ns in $NS_E "${NS_R[@]}"; do ip netns del "$ns" 2>/dev/null; ip netns add "$ns" || die "ip netns add $ns"; done
in_e ip link set lo up
for i in 1 2; do
    ns=${NS_R[$((i-1))]}
    ip link add vrb${i}e type veth peer name vrb${i}r || die "veth $i"
    ip link set vrb${i}e netns $NS_E; ip link set vrb${i}r netns "$ns"
    in_e ip addr add 10.233.$i.2/24 dev vrb${i}e; in_e ip link set vrb${i}e up
    ip netns exec "$ns" ip addr add 10.233.$i.1/24 dev vrb${i}r
    ip netns exec "$ns" ip link set vrb${i}r up; ip netns exec "$ns" ip link set lo up
    for side in "$NS_E vrb${i}e" "$ns vrb${i}r"; do
        set -- $side
        if [ -n "$NETEM" ]; then
            ip netns exec "$1" tc qdisc add dev "$2" root handle 1: netem $NETEM || die "tc netem $NETEM"
            [ -z "$LINK" ] || ip netns exec "$1" tc qdisc add dev "$2" parent 1: handle 2: tbf $LINK || die "tc tbf $LINK"
        elif [ -n "$LINK" ]; then
            ip netns exec "$1" tc qdisc add dev "$2" root tbf $LINK || die "tc tbf $LINK"
        fi
    done
done

start_replica() { # INDEX (1|2) [b: VOUCH_B's replica, port 711INDEX]
    local i=$1 ns=${NS_R[$(($1-1))]} vouch=$VOUCH port=710$1 key=$1
    if [ "${2:-}" = b ]; then vouch=$VOUCH_B; port=711$1; key=b$1; fi
    ip netns exec "$ns" "$vouch" replica serve "$DIR/r$key" --listen "10.233.$i.1:$port" --insecure \
        >> "$OUT/logs/replica$key.log" 2>&1 &
    RPID[$key]=$!
    for _ in $(seq 100); do grep -q "serving" "$OUT/logs/replica$key.log" 2>/dev/null && return 0; sleep 0.1; done
    die "replica $key did not start: $(tail -3 "$OUT/logs/replica$key.log")"
}
wait_port() { # PORT
    for _ in $(seq 200); do in_e bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null && return 0; sleep 0.1; done
    return 1
}
start_server() { # NAME [SERVE ARGUMENTS...]
    local s=$1 vol="$DIR/vol-$1" mirrors=() vouch=$VOUCH base=${1%_b}
    shift
    [[ $s == *_b ]] && vouch=$VOUCH_B
    case $base in
    local2|local3) for i in $(seq 1 $((${base#local} - 1))); do mirrors+=(--mirror "$vol-leg$i"); done ;;
    remote2|remote3)
        local port=710; [[ $s == *_b ]] && port=711
        for i in $(seq 1 $((${base#remote} - 1))); do mirrors+=(--mirror "vouch://10.233.$i.1:$port$i/$s"); done ;;
    esac
    if [ ! -d "$vol" ]; then
        in_e "$vouch" create "$vol" --size "$SIZE" "${mirrors[@]}" > "$OUT/logs/$s.create.log" 2>&1 \
            || die "$s: create: $(cat "$OUT/logs/$s.create.log")"
    fi
    ip netns exec $NS_E "$vouch" serve "$vol" --listen "127.0.0.1:${PORT[$s]}" "$@" >> "$OUT/logs/$s.log" 2>&1 &
    PID[$s]=$!
    wait_port "${PORT[$s]}" || die "$s did not listen: $(tail -5 "$OUT/logs/$s.log")"
}
stop_server() { # NAME
    local p=${PID[$1]}; kill -TERM "$p"; wait "$p" 2>/dev/null; unset "PID[$1]"
}
ticks() { local s; s=$(cat "/proc/$1/stat" 2>/dev/null) || { echo 0; return; }; s=${s##*) }; set -- $s; echo $(( ${12} + ${13} )); }
# Context switches of every thread of process PID so far (voluntary + involuntary).
switches() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^(non)?voluntary_ctxt_switches/ {n += $2} END {print n + 0}'; }
replica_ticks() { local t=0 p; for p in "${RPID[@]}"; do t=$((t + $(ticks "$p"))); done; echo $t; }
HZ=$(getconf CLK_TCK)

start_replica 1; start_replica 2
if [ -n "$VOUCH_B" ]; then start_replica 1 b; start_replica 2 b; fi
for s in $SERVERS; do
    start_server "$s"
    log "$s: prefill (sequential 1M writes)"
    in_e fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:${PORT[$s]}" --rw=write --bs=1M --iodepth=8 \
        --size="$SIZE" > "$OUT/logs/$s.fill.txt" 2>&1 || die "$s: prefill failed"
done

TSV=$OUT/samples.tsv
printf 'rep\tserver\ttest\tiops\tMBps\tios\texporter_s\treplicas_s\n' > "$TSV"
spec() { case $1 in
    rr4k_qd1) echo "randread 4k 1";; rr4k_qd32) echo "randread 4k 32";;
    rw4k_qd1) echo "randwrite 4k 1";; rw4k_qd32) echo "randwrite 4k 32";;
    sr1m_qd8) echo "read 1M 8";; sw1m_qd8) echo "write 1M 8";; *) die "unknown test $1";; esac; }
read -ra order <<< "$SERVERS"
for rep in $(seq "$REPS"); do
    n=${#order[@]}; k=$(( (rep - 1) % n )); rot=("${order[@]:k}" "${order[@]:0:k}")
    [ $((rep % 2)) = 0 ] && rot=($(printf '%s\n' "${rot[@]}" | tac))
    for t in $TESTS; do
        read -r rw bs qd <<< "$(spec "$t")"
        for s in "${rot[@]}"; do
            sync
            json="$OUT/logs/$s-$t-r$rep.json"
            e0=$(ticks "${PID[$s]}"); r0=$(replica_ticks); c0=$(switches "${PID[$s]}")
            in_e timeout $((RUNTIME + 60)) fio --output-format=json --output="$json" --name="$t" --ioengine=nbd \
                --uri="nbd://127.0.0.1:${PORT[$s]}" --rw="$rw" --bs="$bs" --iodepth="$qd" --time_based \
                --runtime="$RUNTIME" --norandommap --randrepeat=0 > /dev/null 2>&1 || log "fio $s $t rc=$?"
            e1=$(ticks "${PID[$s]}"); r1=$(replica_ticks); c1=$(switches "${PID[$s]}")
            row=$(python3 - "$json" "$rw" <<'PY'
import json, sys
s = open(sys.argv[1]).read(); j = json.loads(s[s.index('{'):])["jobs"][0]
d = j["write" if "write" in sys.argv[2] else "read"]
print("%.1f\t%.2f\t%d" % (d["iops"], d["bw_bytes"] / 1e6, d["total_ios"]))
PY
) || row="0	0	0"
            es=$(awk -v d=$((e1 - e0)) -v hz="$HZ" 'BEGIN{printf "%.3f", d/hz}')
            rs=$(awk -v d=$((r1 - r0)) -v hz="$HZ" 'BEGIN{printf "%.3f", d/hz}')
            printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$s" "$t" "$row" "$es" "$rs" >> "$TSV"
            printf '%s\t%s\t%s\t%s\t%s\n' "$rep" "$s" "$t" "$(cut -f3 <<< "$row")" $((c1 - c0)) >> "$OUT/switches.tsv"
            log "r$rep $s $t: $(cut -f1,2 <<< "$row" | tr '\t' ' ') (iops MB/s) exporter ${es}s replicas ${rs}s"
        done
    done
done

# ---------------------------------------------------------------- an exporter crash: the replica reconciles
CRASHED=""
if [ "$CRASH" = 1 ] && [[ " $SERVERS " == *" remote2 "* ]]; then
    log "crash: random 64 KiB writes to remote2 for ${CRASH_SECONDS}s, then kill -9 of its exporter"
    in_e fio --name=stream --ioengine=nbd --uri="nbd://127.0.0.1:${PORT[remote2]}" --rw=randwrite --bs=64k \
        --iodepth=8 --size="$SIZE" --fsync=256 --time_based --runtime=$((CRASH_SECONDS * 4)) \
        > "$OUT/logs/crash-writes.txt" 2>&1 &
    stream=$!
    sleep "$CRASH_SECONDS"
    kill -KILL "${PID[remote2]}"; wait "${PID[remote2]}" 2>/dev/null; unset "PID[remote2]"
    wait "$stream" 2>/dev/null
    t0=$(date +%s.%N)
    start_server remote2 --control "127.0.0.1:$CONTROL_PORT" --resync-max "$RECONCILE_MAX"
    status="$OUT/logs/crash-status.json"
    insync=""
    for _ in $(seq 1200); do
        in_e "$VOUCH" mirror status vol-remote2 --server "http://127.0.0.1:$CONTROL_PORT" --json > "$status" 2>/dev/null
        if python3 -c 'import json,sys; l=json.load(open(sys.argv[1]))["legs"][1]; sys.exit(0 if l["state"]=="active" else 1)' \
            "$status"; then
            insync=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}')
            break
        fi
        sleep 0.05
    done
    [ -n "$insync" ] || die "crash: the replica was not in sync after 60 s: $(cat "$status")"
    scrub=""
    if [ "$SCRUB" = 1 ]; then
        stop_server remote2
        in_e "$VOUCH" scrub "$DIR/vol-remote2" --json > "$OUT/logs/crash-scrub.json" 2>&1 || log "crash: scrub exited non-zero"
        scrub=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print("scrub afterwards: %d found, %d corrected" % (s["report"]["found"], sum(l.get("corrected", 0) for l in s["legs"])))' \
            "$OUT/logs/crash-scrub.json") || scrub="scrub output unreadable"
        start_server remote2
    fi
    CRASHED=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["legs"][1]["reconcile"]; print("%d regions (4 MiB), %d blocks checked, %d copied, reconciled in %.2f s" % (r["regions"], r["blocks_checked"], r["blocks_copied"], r["elapsed_ms"] / 1000))' \
        "$status")
    CRASHED="$CRASHED; in sync $insync s after the restart began${scrub:+; $scrub}"
    log "crash: $CRASHED"
fi

# ---------------------------------------------------------------- resync of a remote leg across the link
RESYNC=""
if [[ " $SERVERS " == *" remote2 "* ]] && [ "$RESYNC_WRITE" != 0 ]; then
    # A flush first: the blocks written since the last flush (here: the whole benchmark's) join a lost
    # leg's resync map, since the replica may not have made them durable.
    in_e fio --name=flush --ioengine=nbd --uri="nbd://127.0.0.1:${PORT[remote2]}" --rw=write --bs=4k \
        --size=4k --end_fsync=1 > "$OUT/logs/resync-flush.txt" 2>&1 || die "flush failed"
    log "resync: SIGKILL replica 1, $RESYNC_WRITE of 64 KiB random writes to remote2"
    kill -KILL "${RPID[1]}"; wait "${RPID[1]}" 2>/dev/null; unset "RPID[1]"
    in_e fio --name=away --ioengine=nbd --uri="nbd://127.0.0.1:${PORT[remote2]}" --rw=randwrite --bs=64k \
        --iodepth=8 --size="$SIZE" --io_size="$RESYNC_WRITE" --randrepeat=0 --norandommap \
        > "$OUT/logs/resync-writes.txt" 2>&1 || die "resync writes failed"
    stop_server remote2
    start_replica 1
    in_e "$VOUCH" mirror status "$DIR/vol-remote2" > "$OUT/logs/resync-status-before.txt" 2>&1
    t0=$(date +%s.%N)
    in_e "$VOUCH" mirror resync "$DIR/vol-remote2" --leg 1 --rate 4G > "$OUT/logs/resync.txt" 2>&1 \
        || die "resync failed: $(tail -3 "$OUT/logs/resync.txt")"
    t1=$(date +%s.%N)
    in_e "$VOUCH" check "$DIR/vol-remote2" > "$OUT/logs/resync-check.txt" 2>&1 \
        || die "check after resync: $(tail -5 "$OUT/logs/resync-check.txt")"
    RESYNC="$(tail -1 "$OUT/logs/resync.txt") in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}') s; check clean"
    log "resync: $RESYNC"
fi

python3 - "$TSV" "$SERVERS" "$TESTS" "$RESYNC" "SIZE=$SIZE REPS=$REPS RUNTIME=$RUNTIME LINK='$LINK' NETEM='$NETEM'" \
    "$CRASHED" > "$OUT/report.md" <<'PY'
import csv, statistics, sys
tsv, servers, tests, resync, knobs = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4], sys.argv[5]
crashed = sys.argv[6]
rows = list(csv.DictReader(open(tsv), delimiter="\t"))
def med(s, t, f):
    v = [float(r[f]) for r in rows if r["server"] == s and r["test"] == t]
    return statistics.median(v) if v else float("nan")
def per_io(s, t, f):
    v = [float(r[f]) * 1e6 / float(r["ios"]) for r in rows if r["server"] == s and r["test"] == t and float(r["ios"]) > 0]
    return statistics.median(v) if v else float("nan")
print(f"# bench/remote.sh: {knobs}\n")
print("IOPS (medians) and ratio to `single`; CPU: exporter / replica servers, µs per I/O\n")
pairs = [s for s in servers if s + "_b" in servers]
print("| test | " + " | ".join(servers + [f"{s}/{s}_b" for s in pairs]) + " |")
print("|---" * (len(servers) + len(pairs) + 1) + "|")
for t in tests:
    base = med("single", t, "iops") if "single" in servers else float("nan")
    cells = []
    for s in servers:
        i = med(s, t, "iops")
        cell = f"{i:,.0f}"
        if s != "single" and base == base and base > 0:
            cell += f" ({i / base:.2f}x)"
        cell += f"<br>{per_io(s, t, 'exporter_s'):.0f}/{per_io(s, t, 'replicas_s'):.0f} µs"
        cells.append(cell)
    for s in pairs:
        # Per round: each round ran both back to back.
        ratios = []
        for rep in sorted({r["rep"] for r in rows}):
            a = [float(r["iops"]) for r in rows if r["server"] == s and r["test"] == t and r["rep"] == rep]
            b = [float(r["iops"]) for r in rows if r["server"] == s + "_b" and r["test"] == t and r["rep"] == rep]
            if a and b and b[0] > 0:
                ratios.append(a[0] / b[0])
        cells.append(f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})" if ratios else "-")
    print(f"| {t} | " + " | ".join(cells) + " |")
if crashed:
    print(f"\nReconciliation of remote2 after kill -9 of its exporter under random 64 KiB writes: {crashed}")
if resync:
    print(f"\nResync of remote2's leg 1 across the link (offline `vouch mirror resync`): {resync}")
PY
log "report: $OUT/report.md"; cat "$OUT/report.md"
