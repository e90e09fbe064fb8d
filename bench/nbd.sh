#!/usr/bin/env bash
# bench/nbd.sh -- vouch served over NBD vs qemu-nbd and nbdkit, measured with fio --ioengine=nbd
# in one run on one machine (everything on 127.0.0.1).
#
# Servers (all started once, kept running for the whole run, driven one at a time):
#   vouch_split   vouch serve, split layout, fresh volume of SIZE, prefilled (fio seq 1M write via NBD)
#   vouch_packed  vouch serve, packed layout, same
#   vouch_mirror2, vouch_mirror3   vouch serve of a local 2-way / 3-way mirror (split; legs
#                 vol-mirrorN, vol-mirrorN-leg1, -leg2 in DIR), prefilled like vouch_split; report.md
#                 gets a "mirror vs single" section (ratios to vouch_split); not in the default set
#   vouch_split_direct, vouch_packed_direct   the same with `serve --direct` (O_DIRECT data
#                 segments: the like-for-like comparison with qemu-nbd --cache=none; not in the default set)
#   qemunbd       qemu-nbd -f raw -t -e 8 --cache=none --aio=io_uring    (O_DIRECT, page cache evicted first)
#   qemunbd_wb    qemu-nbd -f raw -t -e 8 --cache=writeback --aio=threads (qemu-nbd's own defaults: page
#                 cache, flush = fdatasync; file warmed first like nbdkit_pc; not in the default set)
#   nbdkit_none   nbdkit file cache=none fadvise=random                  (page cache evicted first)
#   nbdkit_pc     nbdkit file (default: page cache; file warmed first)   (buffered ceiling, like vouch)
# The anchors serve one prefilled raw file of SIZE in DIR (same filesystem as the volumes).
#
# A/B against an older vouch (the "costs nothing" check of an engine change): VOUCH_BASE=/path/to/old/vouch
# enables base_split, base_packed, base_split_direct, base_packed_direct (and base_mirror2,
# base_mirror3): exactly the vouch_* servers (own volumes vol-base-*, own ports, own prefill) but
# running $VOUCH_BASE. They are interleaved with
# every other server in the same repetitions, and report.md gets a "new vs base" section per pair:
# per-repetition ratios vouch_X/base_X (same repetition), their median, the ratio of the medians, and a
# flag on every test whose median per-repetition ratio is < AB_THRESHOLD (0.95). With VOUCH_BASE set
# and SERVERS not given, SERVERS defaults to the four pairs (no anchors), e.g.
#   VOUCH_BASE=/work/base/target/release/vouch REPS=5 bench/nbd.sh
#   VOUCH_BASE=... SERVERS="vouch_split_direct base_split_direct" TESTS="rr4k_qd32 rw4k_qd32" bench/nbd.sh
# (bench/AB.md: the whole A/B procedure, with bench/ab-engine.sh for the engine level.)
#
# Workloads (fio --norandommap --randrepeat=0, numjobs=1, whole export):
#   4 KiB randread / randwrite at iodepth 1 and 32, 1 MiB seq read / write at iodepth 8 (RUNTIME s each)
#   rw4k_fsync1: 4 KiB randwrite QD1, fio --fsync=1 (an NBD_CMD_FLUSH after every write)
#   rw4k_fsync8: 4 KiB randwrite QD1, fio --fsync=8 (a flush every 8 writes: database-like)
#     (fio's nbd engine turns fio's sync I/O into nbd_aio_flush, i.e. NBD_CMD_FLUSH; the flush count and
#      mean flush latency come from the "sync" section of fio's JSON and are in samples.tsv / report.md.
#      IOPS of these tests count writes only.)
#   rw512_qd1, rw512_qd32: 512-byte randwrite at iodepth 1 and 32 (fio --bs=512, so 512-aligned: the
#     cost of sub-block writes, which vouch read-modify-writes per 4 KiB block; report.md compares them
#     with rw4k_qd1/qd32 of the same repetition. fio's nbd engine (libnbd) asks for block sizes, vouch
#     advertises a 512-byte minimum, so these are valid requests for a negotiating client.)
#   randread of N x 4 KiB, N in SWEEP_BLOCKS, iodepth 1 and 8 (SWEEP_RUNTIME s each)
# Repetitions, INTERLEAVE=server (the default without VOUCH_BASE): for rep in 1..REPS: for server in
#   (order): run the whole matrix. INTERLEAVE=test (the default with VOUCH_BASE): for rep: for test: for
#   server in (order): run that test, so every server is measured seconds apart (cache state prepared
#   before each run: cheap for vouch_*/base_*, a re-read or eviction of the raw image for the anchors).
#   Order: round K (K = rep-1, or rep-1+test index) runs the server list rotated by K/2 and reversed when
#   K is odd, so rounds 2r and 2r+1 run every pair (e.g. vouch_X, base_X) in both orders.
# Per run: IOPS, MB/s, fio usr/sys CPU, machine CPU busy % (/proc/stat), server CPU time
# (utime+stime of the server process, /proc/PID/stat) per I/O; for vouch servers (serving metrics on
# port + 100) the log line also gives the share of the test's requests answered inline (inline=N%).
#
# Scheduling: the script, its servers and fio run under the policy it is started with (facts.md records it).
#   Quiet runs use `nice -n -10 bash bench/nbd.sh` (SCHED_OTHER: the kernel's wake-up placement that a
#   deployment has, ahead of other nice-0 work), the anchors under the same. Not `chrt -f 10`: on 2 vCPUs
#   SCHED_FIFO places each wake-up of a QD1 exchange (fio <-> the server's reactor) on the other vCPU
#   unless a FIFO thread already runs there, so the QD1 tests (rr4k_qd1, rw4k_qd1, rw4k_fsync1,
#   rw4k_fsync8) also measure how long a server keeps a thread busy on the other vCPU: a server that
#   spends more CPU per I/O there keeps the exchange on one vCPU and answers sooner (a build whose
#   workers spent twice the CPU per write+flush-every-8 I/O measured 1.4x faster). Under a realtime policy the
#   script warns.
#
# Output: $OUT/samples.tsv (one row per run), $OUT/report.md (medians, ratios, targets),
#         $OUT/fio/*.json (raw fio output), $OUT/logs/ (server logs).
#
# Knobs (environment; e.g. SERVERS="vouch_split_direct vouch_split qemunbd" for the cache=none comparison):
#   SIZE RUNTIME SWEEP_RUNTIME REPS DIR OUT SERVERS PORT_BASE VOUCH BUILD KEEP_RAW: see their defaults below
#   SWEEP_BLOCKS  block counts of the read sweep ("none": no sweep)
#   TESTS         main-matrix tests to run, by name (default: all of MATRIX below)
#   VOUCH_BASE    second vouch binary for the base_* servers (A/B); AB_THRESHOLD flag level (0.95)
#   REPORT_ONLY=1 only rebuild $OUT/report.md from $OUT/samples.tsv
ENV_KNOBS="SIZE RUNTIME SWEEP_RUNTIME REPS DIR OUT SERVERS SWEEP_BLOCKS TESTS PORT_BASE VOUCH VOUCH_BASE BUILD KEEP_RAW AB_THRESHOLD INTERLEAVE"  # (REPORT_ONLY is not a measurement knob)
GIVEN_ENV=""
for _v in $ENV_KNOBS; do [ -n "${!_v+x}" ] && GIVEN_ENV+="$_v=${!_v} "; done
SIZE=${SIZE:-4G}                       # volume / raw image size (IEC: 4G = 4 GiB)
RUNTIME=${RUNTIME:-10}                 # seconds per main-matrix fio run
SWEEP_RUNTIME=${SWEEP_RUNTIME:-5}      # seconds per block-size-sweep run
REPS=${REPS:-3}                        # repetitions (servers interleaved within each)
DIR=${DIR:-/var/tmp/vouch-nbd-bench}   # volumes, raw image, pid files
OUT=${OUT:-$DIR/results}               # results (overwritten each run)
VOUCH_BASE=${VOUCH_BASE:-}             # A/B: older vouch binary for the base_* servers (empty: none)
AB_THRESHOLD=${AB_THRESHOLD:-0.95}     # A/B: flag tests whose median per-rep vouch_X/base_X is below this
INTERLEAVE=${INTERLEAVE:-$([ -n "$VOUCH_BASE" ] && echo test || echo server)}  # see the header
case $INTERLEAVE in server|test) ;; *) echo "INTERLEAVE must be server or test" >&2; exit 1 ;; esac
if [ -n "$VOUCH_BASE" ]; then
    SERVERS=${SERVERS:-"vouch_split base_split vouch_packed base_packed vouch_split_direct base_split_direct vouch_packed_direct base_packed_direct"}
else
    SERVERS=${SERVERS:-"vouch_split vouch_packed qemunbd nbdkit_none nbdkit_pc"}
fi
SWEEP_BLOCKS=${SWEEP_BLOCKS:-"1 4 16 64 256 1024"}
[ "$SWEEP_BLOCKS" = none ] && SWEEP_BLOCKS=""
PORT_BASE=${PORT_BASE:-10930}          # ports PORT_BASE .. PORT_BASE+11
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VOUCH=${VOUCH:-$REPO/target/release/vouch}
BUILD=${BUILD:-1}                      # 1: cargo build --release -p vouch first
KEEP_RAW=${KEEP_RAW:-1}                # 1: keep the filled raw image for the next run (vouch volumes are always removed)
REPORT_ONLY=${REPORT_ONLY:-0}          # 1: only rebuild $OUT/report.md from $OUT/samples.tsv

set -u
export LC_ALL=C
CMDLINE="${GIVEN_ENV}$0${*:+ $*}"
RAW="$DIR/raw.img"
RUN="$DIR/run"
TSV="$OUT/samples.tsv"
REPORT="$OUT/report.md"
NCPU=$(nproc)
HZ=$(getconf CLK_TCK)
BYTES=$(numfmt --from=iec "$SIZE")

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }

declare -A PORT=( [vouch_split]=$PORT_BASE [vouch_packed]=$((PORT_BASE+1)) [qemunbd]=$((PORT_BASE+2))
                  [nbdkit_none]=$((PORT_BASE+3)) [nbdkit_pc]=$((PORT_BASE+4))
                  [vouch_split_direct]=$((PORT_BASE+5)) [vouch_packed_direct]=$((PORT_BASE+6))
                  [qemunbd_wb]=$((PORT_BASE+7))
                  [base_split]=$((PORT_BASE+8)) [base_packed]=$((PORT_BASE+9))
                  [base_split_direct]=$((PORT_BASE+10)) [base_packed_direct]=$((PORT_BASE+11))
                  [vouch_mirror2]=$((PORT_BASE+12)) [vouch_mirror3]=$((PORT_BASE+13))
                  [base_mirror2]=$((PORT_BASE+14)) [base_mirror3]=$((PORT_BASE+15)) )
for s in $SERVERS; do
    [ -n "${PORT[$s]:-}" ] || die "unknown server $s"
    [[ $s != base_* ]] || [ -n "$VOUCH_BASE" ] || die "server $s needs VOUCH_BASE=/path/to/old/vouch"
done

# ---------------------------------------------------------------- packages
need_pkgs() {
    local missing=() p
    for p in fio nbdkit qemu-utils; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing missing packages: ${missing[*]}"
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" \
        || die "apt-get install ${missing[*]} failed"
}

# ---------------------------------------------------------------- cleanup (idempotent)
stop_pid() { # PID [grace-seconds]
    local p=$1 grace=${2:-30}
    [ -n "$p" ] && kill -0 "$p" 2>/dev/null || return 0
    kill -TERM "$p" 2>/dev/null
    for _ in $(seq $((grace*10))); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.1; done
    log "pid $p did not stop in ${grace}s: SIGKILL"; kill -KILL "$p" 2>/dev/null
}
cleanup() {
    local f
    for f in "$RUN"/*.pid; do
        [ -e "$f" ] || continue
        stop_pid "$(cat "$f" 2>/dev/null)" 60
        rm -f "$f"
    done
    rm -rf "$DIR"/vol-* "$RUN/vouch" "$RUN/vouch-base"
    [ "$KEEP_RAW" = 1 ] || rm -f "$RAW" "$RAW.filled"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# ---------------------------------------------------------------- helpers
cpu_ticks() { awk '/^cpu /{b=$2+$3+$4+$7+$8+$9; t=b+$5+$6; print b, t}' /proc/stat; }
proc_ticks() { # PID -> utime+stime (ticks, all threads)
    local s; s=$(cat "/proc/$1/stat" 2>/dev/null) || { echo 0; return; }
    s=${s##*) }; set -- $s; echo $(( ${12} + ${13} ))
}
server_pid() { cat "$RUN/$1.pid" 2>/dev/null; }
wait_port() { # PORT
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1
    done
    return 1
}
evict_raw() {
    python3 -c "import os,sys; fd=os.open(sys.argv[1],os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)" "$RAW"
}
warm_raw() { dd if="$RAW" of=/dev/null bs=4M status=none; }

make_raw() {
    if [ -f "$RAW" ] && [ "$(stat -c %s "$RAW")" = "$BYTES" ] && [ -f "$RAW.filled" ]; then
        log "raw image $RAW already filled ($SIZE)"; return
    fi
    rm -f "$RAW" "$RAW.filled"
    log "creating + filling raw image $RAW ($BYTES bytes: fallocate, then sequential 1M O_DIRECT write)"
    fallocate -l "$BYTES" "$RAW" || die "fallocate $RAW"
    fio --name=fill --filename="$RAW" --size="$BYTES" --rw=write --bs=1M --direct=1 --ioengine=io_uring \
        --iodepth=8 --output="$OUT/logs/raw-fill.txt" >/dev/null 2>&1 || die "raw fill failed"
    touch "$RAW.filled"; sync
}

start_server() { # NAME
    local s=$1 port=${PORT[$1]}
    case $s in
    vouch_split|vouch_packed|vouch_split_direct|vouch_packed_direct|base_split|base_packed|base_split_direct|base_packed_direct)
        # base_X is vouch_X run by $VOUCH_BASE, with its own volume
        local bin=$VOUCH name=${s#vouch_} vol_prefix=vol-
        if [[ $s == base_* ]]; then bin=$VOUCH_BASE; name=${s#base_}; vol_prefix=vol-base-; fi
        local layout direct=()
        layout=${name%_direct}
        [ "$name" = "$layout" ] || direct=(--direct)
        local vol="$DIR/$vol_prefix$name"
        rm -rf "$vol"
        "$bin" serve "$vol" --create "$BYTES" --layout "$layout" "${direct[@]}" --listen "127.0.0.1:$port" \
            --metrics "127.0.0.1:$((port + 100))" > "$OUT/logs/$s.log" 2>&1 &
        echo $! > "$RUN/$s.pid" ;;
    vouch_mirror2|vouch_mirror3|base_mirror2|base_mirror3)
        # base_mirrorN is vouch_mirrorN run by $VOUCH_BASE, with its own legs
        local bin=$VOUCH vol="$DIR/vol-${s#vouch_}" mirrors=()
        if [[ $s == base_* ]]; then bin=$VOUCH_BASE; vol="$DIR/vol-base-${s#base_}"; fi
        local legs=${s#*_mirror}
        rm -rf "$vol" "$vol"-leg*
        for i in $(seq 1 $((legs - 1))); do mirrors+=(--mirror "$vol-leg$i"); done
        "$bin" create "$vol" --size "$BYTES" "${mirrors[@]}" > "$OUT/logs/$s.create.log" 2>&1 \
            || die "$s: create failed: $(cat "$OUT/logs/$s.create.log")"
        "$bin" serve "$vol" --listen "127.0.0.1:$port" --metrics "127.0.0.1:$((port + 100))" \
            > "$OUT/logs/$s.log" 2>&1 &
        echo $! > "$RUN/$s.pid" ;;
    qemunbd)
        evict_raw
        qemu-nbd -f raw -t -e 8 --cache=none --aio=io_uring -b 127.0.0.1 -p "$port" \
            --pid-file="$RUN/$s.pid" --fork "$RAW" 2> "$OUT/logs/$s.log" || die "qemu-nbd: $(cat "$OUT/logs/$s.log")" ;;
    qemunbd_wb)
        qemu-nbd -f raw -t -e 8 --cache=writeback --aio=threads -b 127.0.0.1 -p "$port" \
            --pid-file="$RUN/$s.pid" --fork "$RAW" 2> "$OUT/logs/$s.log" || die "qemu-nbd: $(cat "$OUT/logs/$s.log")" ;;
    nbdkit_none)
        nbdkit -P "$RUN/$s.pid" -i 127.0.0.1 -p "$port" file file="$RAW" cache=none fadvise=random \
            2> "$OUT/logs/$s.log" || die "nbdkit: $(cat "$OUT/logs/$s.log")" ;;
    nbdkit_pc)
        nbdkit -P "$RUN/$s.pid" -i 127.0.0.1 -p "$port" file file="$RAW" \
            2> "$OUT/logs/$s.log" || die "nbdkit: $(cat "$OUT/logs/$s.log")" ;;
    esac
    for _ in $(seq 50); do [ -s "$RUN/$s.pid" ] && break; sleep 0.1; done
    wait_port "$port" || die "$s did not listen on $port: $(tail -5 "$OUT/logs/$s.log")"
    log "$s: pid $(server_pid "$s") on nbd://127.0.0.1:$port"
}

# fio_parse JSON -> "iops MBps total_ios clat_us p99_us usr sys err flushes flush_lat_us" for direction DIR
# (read|write); flushes = fio sync I/Os (NBD_CMD_FLUSH with the nbd engine), flush_lat_us their mean latency
fio_parse() {
    python3 - "$1" "$2" <<'PY'
import json, sys
s = open(sys.argv[1]).read()
j = json.loads(s[s.index('{'):])["jobs"][0]
d = j[sys.argv[2]]
p99 = d.get("clat_ns", {}).get("percentile", {}).get("99.000000", 0) / 1e3
sync = j.get("sync", {})
flushes = sync.get("total_ios", 0)
flush_lat = sync.get("lat_ns", {}).get("mean", 0) / 1e3 if flushes else float("nan")
print("%.1f %.2f %d %.1f %.1f %.2f %.2f %d %d %.1f" % (d["iops"], d["bw_bytes"] / 1e6, d["total_ios"],
      d["clat_ns"]["mean"] / 1e3, p99, j["usr_cpu"], j["sys_cpu"], j.get("error", 0), flushes, flush_lat))
PY
}

# vouch_counts SERVER DIR(read|write) -> "requests inline" of that command from the server's metrics
# (vouch servers only; empty for the anchors or a server without --metrics)
vouch_counts() {
    case $1 in vouch_*|base_*) ;; *) return 0 ;; esac
    # Summed over the export label (one export per server here).
    curl -s --max-time 2 "http://127.0.0.1:$(( ${PORT[$1]} + 100 ))/metrics" 2>/dev/null | awk -v c="$2" '
        index($1, "vouch_nbd_requests_total{command=\"" c "\",") == 1 { r += $2; seen = 1 }
        index($1, "vouch_nbd_inline_requests_total{command=\"" c "\",") == 1 { i += $2 }
        END { if (seen) print r, i + 0 }'
}

# run_one REP SERVER TEST RW BS QD SECONDS [FIO-ARG...] : one fio run, one TSV row
run_one() {
    local rep=$1 s=$2 test=$3 rw=$4 bs=$5 qd=$6 secs=$7
    shift 7; local extra=("$@")   # the rest: extra fio arguments (e.g. --fsync=8)
    local port=${PORT[$s]} pid; pid=$(server_pid "$s")
    local tag="$s-$test-r$rep" json="$OUT/fio/$s-$test-r$rep.json"
    sync  # start every run with no dirty pages from the previous one
    local b0 t0 b1 t1 p0 p1 w0 w1 rc c0 c1 inline=""
    local dir=read; [[ $rw == *write* ]] && dir=write
    c0=$(vouch_counts "$s" "$dir")
    read -r b0 t0 < <(cpu_ticks); p0=$(proc_ticks "$pid"); w0=$(date +%s.%N)
    timeout --kill-after=10 $((secs + 60)) fio --output-format=json --output="$json" --name="$test" \
        --ioengine=nbd --uri="nbd://127.0.0.1:$port" --rw="$rw" --bs="$bs" --iodepth="$qd" --numjobs=1 \
        --time_based --runtime="$secs" --norandommap --randrepeat=0 "${extra[@]}" > "$OUT/logs/$tag.stdout" 2>&1
    rc=$?
    w1=$(date +%s.%N); p1=$(proc_ticks "$pid"); read -r b1 t1 < <(cpu_ticks)
    c1=$(vouch_counts "$s" "$dir")
    if [ -n "$c0" ] && [ -n "$c1" ]; then  # share of this test's requests answered inline (diagnosis)
        inline=$(echo "$c0 $c1" | awk '{ n = $3 - $1; printf " inline=%.0f%%", (n > 0 ? 100 * ($4 - $2) / n : 0) }')
    fi
    local parsed; parsed=$(fio_parse "$json" "$dir" 2>/dev/null) || parsed="0 0 0 0 0 0 0 1 0 nan"
    [ $rc -ne 0 ] && log "fio $tag rc=$rc (see $OUT/logs/$tag.stdout)"
    set -- $parsed
    local iops=$1 mbps=$2 ios=$3 clat=$4 p99=$5 usr=$6 sys=$7 err=$8 flushes=$9 flush_lat=${10}
    local busy srv_s us_io
    busy=$(awk -v b=$((b1-b0)) -v t=$((t1-t0)) -v n="$NCPU" 'BEGIN{ if (t>0) printf "%.1f", 100*n*b/t; else print 0 }')
    srv_s=$(awk -v d=$((p1-p0)) -v hz="$HZ" 'BEGIN{ printf "%.3f", d/hz }')
    us_io=$(awk -v s="$srv_s" -v n="$ios" 'BEGIN{ if (n>0) printf "%.2f", s*1e6/n; else print "nan" }')
    printf '%s\n' "$rep	$s	$test	$rw	$bs	$qd	$secs	$iops	$mbps	$ios	$clat	$p99	$usr	$sys	$busy	$srv_s	$us_io	$(awk -v a="$w0" -v b="$w1" 'BEGIN{printf "%.2f", b-a}')	$rc	$err	$flushes	$flush_lat" >> "$TSV"
    log "r$rep $s $test: iops=$iops MB/s=$mbps srv_cpu=${srv_s}s (${us_io} us/io) busy=${busy}% rc=$rc$inline${extra[*]:+ (${extra[*]}: $flushes flushes, ${flush_lat} us each)}"
}

# name:rw:bs:qd[:extra fio arguments, comma-separated]
MATRIX="rr4k_qd1:randread:4k:1 rr4k_qd32:randread:4k:32 rw4k_qd1:randwrite:4k:1 rw4k_qd32:randwrite:4k:32 sr1m_qd8:read:1M:8 sw1m_qd8:write:1M:8"
MATRIX+=" rw4k_fsync1:randwrite:4k:1:--fsync=1 rw4k_fsync8:randwrite:4k:1:--fsync=8"
MATRIX+=" rw512_qd1:randwrite:512:1 rw512_qd32:randwrite:512:32"
ALL_TESTS=$(for t in $MATRIX; do printf '%s ' "${t%%:*}"; done)
TESTS=${TESTS:-$ALL_TESTS}
for t in $TESTS; do [[ " $ALL_TESTS " == *" $t "* ]] || die "unknown test $t (known: $ALL_TESTS)"; done

prep_cache() { # SERVER : the page-cache state of the raw image this server is measured with
    case $1 in
        qemunbd|nbdkit_none) evict_raw ;;
        nbdkit_pc|qemunbd_wb) warm_raw ;;
    esac
}

# every test of one repetition, in order: name:rw:bs:qd:extra:seconds
test_items() {
    local t name rw bs qd extra n
    for t in $MATRIX; do
        IFS=: read -r name rw bs qd extra <<< "$t"
        [[ " $TESTS " == *" $name "* ]] && echo "$name:$rw:$bs:$qd:$extra:$RUNTIME"
    done
    for n in $SWEEP_BLOCKS; do
        for qd in 1 8; do echo "sweep_${n}x4k_qd$qd:randread:$((n*4))k:$qd::$SWEEP_RUNTIME"; done
    done
}

run_item() { # REP SERVER ITEM
    local name rw bs qd extra secs
    IFS=: read -r name rw bs qd extra secs <<< "$3"
    run_one "$1" "$2" "$name" "$rw" "$bs" "$qd" "$secs" ${extra//,/ }
}

server_block() { # REP SERVER : prepare the cache state, then run the full matrix + sweep
    local item
    prep_cache "$2"
    for item in "${ITEMS[@]}"; do run_item "$1" "$2" "$item"; done
}

server_order() { # K -> the servers rotated by K/2, reversed when K is odd: rounds 2r and 2r+1 run every
    local i n=${#SRV[@]} out=()   # pair of servers in both orders (rotating by K would not: with two
    for i in $(seq 0 $((n-1))); do out+=("${SRV[$(( (i + K / 2) % n ))]}"); done   # servers it undoes the reversal)
    if (( K % 2 )); then for (( i=n-1; i>=0; i-- )); do echo "${out[$i]}"; done
    else printf '%s\n' "${out[@]}"; fi
}

bin_facts() { # BINARY -> "path, sha256 prefix, --version, git commit of the tree it sits in (if any)"
    local b=$1 rev
    rev=$(git -C "$(dirname "$b")" rev-parse --short HEAD 2>/dev/null) \
        && { git -C "$(dirname "$b")" diff --quiet HEAD -- crates 2>/dev/null || rev+="+dirty"; }
    echo "\`$b\` (sha256 $(sha256sum "$b" | cut -c1-12), $("$b" --version 2>/dev/null | head -1)${rev:+, tree at $rev})"
}

sched_policy() { # the scheduling policy and nice value this script runs under (inherited by servers and fio)
    local policy
    policy=$(chrt -p $$ 2>/dev/null | awk -F': ' '/policy/{p=$2} /priority/{if ($2 > 0) p=p" priority "$2} END{print p}')
    echo "${policy:-unknown}, nice $(nice)"
}

machine_facts() {
    echo "- command: \`$CMDLINE\` (cwd $(pwd))"
    echo "- scheduling: $(sched_policy) (servers and fio inherit it)"
    echo "- date: $(date -Is), host $(hostname)"
    echo "- nproc: $NCPU; CPU: $(grep -m1 '^model name' /proc/cpuinfo | sed 's/.*: //'); RAM: $(awk '/MemTotal/{printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
    echo "- kernel: $(uname -r)"
    echo "- directory: $DIR on $(findmnt -n -o FSTYPE,SOURCE,OPTIONS -T "$DIR" | awk '{print $1" ("$2", "$3")"}')"
    echo "- fio $(fio --version | sed 's/fio-//'), $(qemu-nbd --version | head -1), $(nbdkit --version), vouch $(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null)$(cd "$REPO" && git diff --quiet HEAD -- crates 2>/dev/null || echo '+dirty')"
    echo "- vouch binary (vouch_*): $(bin_facts "$VOUCH_SRC")"
    [ -z "$VOUCH_BASE" ] || echo "- base binary (base_*): $(bin_facts "$VOUCH_BASE_SRC")"
    echo "- settings: SIZE=$SIZE ($BYTES bytes) RUNTIME=$RUNTIME SWEEP_RUNTIME=$SWEEP_RUNTIME REPS=$REPS INTERLEAVE=$INTERLEAVE SERVERS=\"$SERVERS\" SWEEP_BLOCKS=\"$SWEEP_BLOCKS\" TESTS=\"$TESTS\""
}

# ---------------------------------------------------------------- report
make_report() {
    python3 - "$TSV" "$OUT/facts.md" "$OUT/prefill.txt" "$RUNTIME" "$SWEEP_RUNTIME" "$REPS" "$AB_THRESHOLD" > "$REPORT" <<'PY'
import csv, sys, statistics as st
from collections import defaultdict
tsv, facts, prefill, runtime, sweep_rt, reps, ab_thr = sys.argv[1:8]
ab_thr = float(ab_thr)
rows = list(csv.DictReader(open(tsv), delimiter="\t"))
S = defaultdict(list)
order_t, order_s = [], []
for r in rows:
    k = (r["server"], r["test"])
    S[k].append(r)
    if r["test"] not in order_t: order_t.append(r["test"])
    if r["server"] not in order_s: order_s.append(r["server"])
# settings as actually run (so REPORT_ONLY=1 needs no matching environment)
reps = max((int(r["rep"]) for r in rows), default=0)
runtime = next((r["runtime_s"] for r in rows if not r["test"].startswith("sweep_")), runtime)
sweep_rt = next((r["runtime_s"] for r in rows if r["test"].startswith("sweep_")), sweep_rt)
pref = ["vouch_split", "base_split", "vouch_packed", "base_packed", "vouch_split_direct", "base_split_direct",
        "vouch_packed_direct", "base_packed_direct", "vouch_mirror2", "base_mirror2", "vouch_mirror3",
        "base_mirror3",
        "qemunbd", "qemunbd_wb", "nbdkit_none", "nbdkit_pc"]
servers = [s for s in pref if s in order_s] + [s for s in order_s if s not in pref]
def med(s, t, f):
    v = [float(r[f]) for r in S.get((s, t), []) if r.get(f) not in (None, "nan", "") and r["rc"] == "0"]
    return st.median(v) if v else float("nan")
def spread(s, t, f):
    v = [float(r[f]) for r in S.get((s, t), []) if r["rc"] == "0"]
    m = st.median(v) if v else 0
    return 100 * (max(v) - min(v)) / 2 / m if v and m else float("nan")
def ratio(a, b):
    return a / b if b and b == b and a == a else float("nan")
def fmt(x, d=0):
    return "-" if x != x else f"{x:,.{d}f}"
main = [t for t in order_t if not t.startswith("sweep_")]
sweep = [t for t in order_t if t.startswith("sweep_")]
vouch = [s for s in servers if s.startswith("vouch")]
anch = [s for s in ("qemunbd", "qemunbd_wb", "nbdkit_none", "nbdkit_pc") if s in servers]
out = []
P = out.append
P("# vouch over NBD vs qemu-nbd / nbdkit (bench/nbd.sh)\n")
P(open(facts).read())
try: P("- prefill through NBD: " + "; ".join(l.strip() for l in open(prefill)) + "\n")
except OSError: pass
P(f"Medians of {reps} repetitions ({runtime} s per main test, {sweep_rt} s per sweep test); "
  "± = half the min-max range in % of the median. fio --ioengine=nbd, numjobs=1, whole export, "
  "--norandommap --randrepeat=0.\n")
P("## Throughput (IOPS; MB/s for 1 MiB tests)\n")
P("| test | " + " | ".join(servers) + " |")
P("|---|" + "---:|" * len(servers))
for t in main:
    f = "MBps" if "1m" in t else "iops"
    P(f"| {t} | " + " | ".join(f"{fmt(med(s,t,f))} ±{fmt(spread(s,t,f))}%" for s in servers) + " |")
P("")
P("## Ratios (median / median)\n")
pairs = [(v, a) for v in vouch for a in anch]
P("| test | " + " | ".join(f"{v.replace('vouch_','')}/{a}" for v, a in pairs) + " |")
P("|---|" + "---:|" * len(pairs))
for t in main + sweep:
    f = "MBps" if "1m" in t else "iops"
    P(f"| {t} | " + " | ".join(fmt(ratio(med(v,t,f), med(a,t,f)), 2) for v, a in pairs) + " |")
P("")
mirrors = [s for s in ("vouch_mirror2", "vouch_mirror3") if s in servers]
if mirrors and "vouch_split" in servers:
    P("## Mirror vs single (local legs; ratio of medians to vouch_split; issue 14 targets: reads >= 1.0x, writes >= 0.7x)\n")
    P("| test | " + " | ".join(f"{m.replace('vouch_','')}/split" for m in mirrors) + " | target |")
    P("|---|" + "---:|" * len(mirrors) + "---|")
    for t in main:
        f = "MBps" if "1m" in t else "iops"
        target = 1.0 if t.startswith(("rr", "sr")) else 0.7
        P(f"| {t} | " + " | ".join(fmt(ratio(med(m,t,f), med("vouch_split",t,f)), 2) for m in mirrors)
          + f" | >= {target} |")
    P("")
sub = [(q, f"rw512_{q}", f"rw4k_{q}") for q in ("qd1", "qd32") if f"rw512_{q}" in main and f"rw4k_{q}" in main]
if sub:
    P("## Sub-block writes: 512 B vs 4 KiB random writes (IOPS, same repetition)\n")
    P("Per rep: IOPS of rw512 / IOPS of rw4k at the same QD in the same repetition; vouch read-modify-writes "
      "the 4 KiB block a 512-byte write covers (read + verify + patch + seal).\n")
    P("| server | QD | rw512 IOPS (median) | rw4k IOPS (median) | per-rep rw512/rw4k | median |")
    P("|---|---:|---:|---:|---|---:|")
    for s in servers:
        for q, small, big in sub:
            a = {r["rep"]: float(r["iops"]) for r in S.get((s, small), []) if r["rc"] == "0"}
            b = {r["rep"]: float(r["iops"]) for r in S.get((s, big), []) if r["rc"] == "0"}
            per = [a[k] / b[k] for k in sorted(a, key=int) if k in b and b[k] > 0]
            P(f"| {s} | {q[2:]} | {fmt(med(s,small,'iops'))} | {fmt(med(s,big,'iops'))} | "
              + " ".join(f"{x:.2f}" for x in per) + f" | {fmt(st.median(per), 2) if per else '-'} |")
    P("")
P("## Server CPU per I/O (µs of server utime+stime per request; lower is better)\n")
P("| test | " + " | ".join(servers) + " |")
P("|---|" + "---:|" * len(servers))
for t in main + sweep:
    P(f"| {t} | " + " | ".join(fmt(med(s,t,"server_cpu_us_per_io"), 1) for s in servers) + " |")
P("")
P("## CPU during the run: machine busy / server / fio client / everything else (% of one CPU; the machine has nproc CPUs)\n")
P("server = server utime+stime over the fio wall time; fio = fio usr+sys; else = busy - server - fio "
  "(kernel threads, softirq work not charged to either process, and any other process on the machine).\n")
def srv_pct(s, t):
    v = [100 * float(r["server_cpu_s"]) / float(r["wall_s"]) for r in S.get((s, t), []) if float(r["wall_s"]) > 0]
    return st.median(v) if v else float("nan")
def other_pct(s, t):
    v = [float(r["machine_busy_pct"]) - 100 * float(r["server_cpu_s"]) / float(r["wall_s"])
         - float(r["fio_usr_pct"]) - float(r["fio_sys_pct"]) for r in S.get((s, t), []) if float(r["wall_s"]) > 0]
    return st.median(v) if v else float("nan")
P("| test | " + " | ".join(f"{s}" for s in servers) + " |")
P("|---|" + "---:|" * len(servers))
for t in main + sweep:
    P(f"| {t} | " + " | ".join(f"{fmt(med(s,t,'machine_busy_pct'))} / {fmt(srv_pct(s,t))} / {fmt(med(s,t,'fio_usr_pct')+med(s,t,'fio_sys_pct'))} / {fmt(other_pct(s,t))}" for s in servers) + " |")
P("")
P("## Random-read block-size sweep (Crucible table shape): IOPS and MB/s\n")
P("| blocks | QD | " + " | ".join(servers) + " |")
P("|---:|---:|" + "---:|" * len(servers))
for t in sweep:
    n, qd = t[len("sweep_"):].split("x4k_qd")
    P(f"| {n} | {qd} | " + " | ".join(f"{fmt(med(s,t,'iops'))} ({fmt(med(s,t,'MBps'))} MB/s)" for s in servers) + " |")
P("")
flush_tests = [t for t in main if any(float(r.get("flushes") or 0) > 0 for s in servers for r in S.get((s, t), []))]
if flush_tests:
    P("## Flush-heavy tests: writes/s, flushes/s, mean flush latency\n")
    P("fio `--fsync=N` with the nbd engine: an NBD_CMD_FLUSH after every N writes (QD1). "
      "Cell: write IOPS / flushes per second / mean flush latency in µs (medians).\n")
    def fl_rate(s, t):
        v = [float(r["flushes"]) / float(r["runtime_s"]) for r in S.get((s, t), [])
             if r["rc"] == "0" and r.get("flushes") not in (None, "")]
        return st.median(v) if v else float("nan")
    P("| test | " + " | ".join(servers) + " |")
    P("|---|" + "---:|" * len(servers))
    for t in flush_tests:
        P(f"| {t} | " + " | ".join(f"{fmt(med(s,t,'iops'))} / {fmt(fl_rate(s,t))} / {fmt(med(s,t,'flush_lat_us'),1)}" for s in servers) + " |")
    P("")
ab_pairs = [(s, "base_" + s[len("vouch_"):]) for s in servers if s.startswith("vouch_") and "base_" + s[len("vouch_"):] in servers]
ab_flags = []
if ab_pairs:
    P(f"## New vs base (vouch_X = VOUCH, base_X = VOUCH_BASE; flag: median per-rep ratio < {ab_thr:.2f})\n")
    P("Per rep: vouch_X / base_X of the same repetition (IOPS; MB/s for 1 MiB tests; higher is better). "
      "`med rep` = median of those per-rep ratios (the verdict), `med/med` = ratio of the medians. "
      "CPU = server CPU-µs per I/O, vouch_X / base_X (lower is better).\n")
    def by_rep(s, t, f):
        return {r["rep"]: float(r[f]) for r in S.get((s, t), []) if r["rc"] == "0" and r.get(f) not in (None, "", "nan")}
    for new, base in ab_pairs:
        P(f"### {new} / {base}\n")
        P("| test | new | base | per rep | med rep | med/med | CPU/io | verdict |")
        P("|---|---:|---:|---|---:|---:|---:|---|")
        for t in main + sweep:
            f = "MBps" if "1m" in t else "iops"
            a, b = by_rep(new, t, f), by_rep(base, t, f)
            per = [(k, a[k] / b[k]) for k in sorted(a, key=int) if k in b and b[k] > 0]
            mr = st.median([x for _, x in per]) if per else float("nan")
            mm = ratio(med(new, t, f), med(base, t, f))
            cpu = ratio(med(new, t, "server_cpu_us_per_io"), med(base, t, "server_cpu_us_per_io"))
            if mr != mr:
                v = "-"
            elif mr < ab_thr:
                v = f"**SLOWER** {mr:.3f}x"; ab_flags.append(f"{new} {t} {mr:.3f}x")
            elif mm < ab_thr:
                v = "ok (med/med below)"
            else:
                v = "ok"
            P(f"| {t} | {fmt(med(new,t,f))} | {fmt(med(base,t,f))} | " + " ".join(f"{x:.3f}" for _, x in per)
              + f" | {fmt(mr,3)} | {fmt(mm,3)} | {fmt(cpu,2)} | {v} |")
        P("")
    if ab_flags:
        P(f"**A/B verdict: {len(ab_flags)} test(s) slower than {ab_thr:.2f}x base:** " + "; ".join(ab_flags) + "\n")
    else:
        P(f"**A/B verdict: no test below {ab_thr:.2f}x base** (median of per-rep ratios, {reps} rep(s)).\n")
def verdict(x, thr):
    return "-" if x != x else ("**pass** %.2fx" % x if x >= thr else "**FAIL** %.2fx" % x)
if "qemunbd" in servers and vouch:
    P("## Targets (vs qemu-nbd, same run)\n")
    P("| target | " + " | ".join(vouch) + " |")
    P("|---|" + "---|" * len(vouch))
    P("| 4 KiB randread QD32 >= 1.2x | " + " | ".join(verdict(ratio(med(v,"rr4k_qd32","iops"), med("qemunbd","rr4k_qd32","iops")), 1.2) for v in vouch) + " |")
    P("| 4 KiB randwrite QD32 >= 1.0x | " + " | ".join(verdict(ratio(med(v,"rw4k_qd32","iops"), med("qemunbd","rw4k_qd32","iops")), 1.0) for v in vouch) + " |")
    cells = []
    for v in vouch:
        rs = [(t, ratio(med(v,t,"iops"), med("qemunbd",t,"iops"))) for t in sweep]
        rs = [x for x in rs if x[1] == x[1]]
        if not rs: cells.append("-"); continue
        worst = min(rs, key=lambda x: x[1])
        fails = [t[len("sweep_"):] for t, x in rs if x < 1.0]
        cells.append(("**pass**" if not fails else "**FAIL** (%s)" % ", ".join(fails)) + " min %.2fx at %s" % (worst[1], worst[0][len("sweep_"):]))
    P("| every sweep read size >= 1.0x | " + " | ".join(cells) + " |")
P("")
print("\n".join(out))
PY
}

# ---------------------------------------------------------------- main
if [ "$REPORT_ONLY" = 1 ]; then   # rebuild report.md from an existing $OUT (no servers, no fio)
    trap - EXIT
    [ -s "$TSV" ] || die "no $TSV"
    make_report; cat "$REPORT"; exit 0
fi
need_pkgs
mkdir -p "$DIR" "$RUN"
cleanup                       # leftovers of an interrupted run
rm -rf "$OUT"; mkdir -p "$OUT/fio" "$OUT/logs"
if [ "$BUILD" = 1 ]; then
    log "cargo build --release -p vouch"
    (cd "$REPO" && cargo build --release -p vouch) > "$OUT/logs/build.log" 2>&1 || die "build failed: see $OUT/logs/build.log"
fi
[ -x "$VOUCH" ] || die "no vouch binary at $VOUCH"
VOUCH_SRC=$VOUCH VOUCH_BASE_SRC=$VOUCH_BASE
cp "$VOUCH" "$RUN/vouch" && VOUCH="$RUN/vouch"   # snapshot: a rebuild during the run cannot change it
if [ -n "$VOUCH_BASE" ]; then
    [ -x "$VOUCH_BASE" ] || die "no vouch binary at VOUCH_BASE=$VOUCH_BASE"
    cp "$VOUCH_BASE" "$RUN/vouch-base" && VOUCH_BASE="$RUN/vouch-base"
fi
machine_facts > "$OUT/facts.md"
cat "$OUT/facts.md" >&2
case $(sched_policy) in
    SCHED_FIFO*|SCHED_RR*) log "WARNING: running under $(sched_policy): the QD1 tests measure where the kernel wakes fio and the reactor (see the header's Scheduling)" ;;
esac
printf 'rep\tserver\ttest\trw\tbs\tqd\truntime_s\tiops\tMBps\ttotal_ios\tclat_us\tp99_us\tfio_usr_pct\tfio_sys_pct\tmachine_busy_pct\tserver_cpu_s\tserver_cpu_us_per_io\twall_s\trc\tfio_err\tflushes\tflush_lat_us\n' > "$TSV"
T0=$(date +%s)

need_raw=0; for s in $SERVERS; do [[ $s == vouch_* || $s == base_* ]] || need_raw=1; done
[ $need_raw = 1 ] && make_raw
for s in $SERVERS; do
    start_server "$s"
    if [[ $s == vouch_* || $s == base_* ]]; then
        log "$s: prefill (fio seq write 1M QD8 over NBD, $BYTES bytes)"
        sync; w0=$(date +%s.%N)
        fio --name=prefill --ioengine=nbd --uri="nbd://127.0.0.1:${PORT[$s]}" --rw=write --bs=1M --iodepth=8 \
            --size="$BYTES" --output="$OUT/logs/$s-prefill.txt" > /dev/null 2>&1 || die "$s prefill failed"
        w1=$(date +%s.%N)
        log "$s: prefilled in $(awk -v a="$w0" -v b="$w1" 'BEGIN{printf "%.1f s (%.0f MB/s)", b-a, '"$BYTES"'/1e6/(b-a)}')"
        printf '%s\n' "$s prefill: $(awk -v a="$w0" -v b="$w1" 'BEGIN{printf "%.1f s (%.0f MB/s)", b-a, '"$BYTES"'/1e6/(b-a)}')" >> "$OUT/prefill.txt"
    fi
done

SRV=($SERVERS)
mapfile -t ITEMS < <(test_items)
for rep in $(seq "$REPS"); do
    if [ "$INTERLEAVE" = test ]; then   # rep -> test -> server: every server runs a test seconds apart
        for idx in "${!ITEMS[@]}"; do
            K=$(( rep - 1 + idx ))
            log "=== rep $rep/$REPS: ${ITEMS[$idx]%%:*}"
            for s in $(server_order); do prep_cache "$s"; run_item "$rep" "$s" "${ITEMS[$idx]}"; done
        done
    else                                # rep -> server -> test (the whole matrix per server)
        K=$(( rep - 1 ))
        for s in $(server_order); do
            log "=== rep $rep/$REPS: $s"
            server_block "$rep" "$s"
        done
    fi
done
log "measurements done in $(( $(date +%s) - T0 )) s"
make_report

cat "$REPORT"
log "report: $REPORT  samples: $TSV  (total $(( $(date +%s) - T0 )) s)"
