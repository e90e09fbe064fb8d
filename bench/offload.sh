#!/usr/bin/env bash
# bench/offload.sh -- the offloads (issue 10) against doing the same work by hand, in one run:
#
#   verify_link      offloaded verify (control API, and x-vouch:integrity via nbdinfo --map) vs a client
#                    reading every block over NBD (nbdcopy to null:), across a veth link between two
#                    network namespaces shaped to LINK_RATE (tc tbf); data in the server's page cache
#   verify_loopback  the same on 127.0.0.1
#   verify_digest    verify with a proof-of-work seed vs without (the digest's cost)
#   scrub            a full-speed scrub (control API) vs `dd` of the volume's data file, both from the
#                    page cache, and both cold (caches dropped) when COLD=1
#   copy             offloaded copy (control API, method auto: pipelined on ext4) between two exports vs
#                    nbdcopy between the exports and qemu-img convert -n between them
#   copy_reflink     the same on a btrfs made on a loop device (method reflink vs nbdcopy)
#   copy_reflink_xfs the same on an xfs (-m reflink=1) made on a loop device
#   scrub_foreground fio 4 KiB randread QD1 over NBD alone vs while a scrub limited to SCRUB_RATE runs
#
# Every measurement is repeated REPS times, the methods interleaved within each repetition; the
# report gives medians and ratios. Output: $OUT/samples.tsv, $OUT/report.md.
# Knobs: SIZE (4G) REPS (3) DIR OUT LINK_RATE (10gbit) SCRUB_RATE (200M) COLD (0) TESTS (all)
#        VOUCH BUILD (1) KEEP_RAW (1)
# Needs root (netns, tc, loop devices, drop_caches) and: qemu-utils libnbd-bin fio iproute2
# btrfs-progs curl jq.
set -euo pipefail

SIZE=${SIZE:-4G}
REPS=${REPS:-3}
DIR=${DIR:-/var/tmp/vouch-offload-bench}
OUT=${OUT:-$DIR/results}
LINK_RATE=${LINK_RATE:-10gbit}
SCRUB_RATE=${SCRUB_RATE:-100M}
COLD=${COLD:-0}
TESTS=${TESTS:-"verify_link verify_loopback verify_digest scrub copy copy_reflink copy_reflink_xfs scrub_foreground"}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VOUCH=${VOUCH:-$REPO/target/release/vouch}
BUILD=${BUILD:-1}
KEEP_RAW=${KEEP_RAW:-1}

NS_SRV=vob-srv
NS_CLI=vob-cli
SRV_IP=10.232.0.1
CLI_IP=10.232.0.2
NBD_PORT=10850
CONTROL_PORT=10851
LOOP_NBD_PORT=10852
LOOP_CONTROL_PORT=10853

need() { command -v "$1" >/dev/null 2>&1 || { echo "missing $1: apt-get install -y $2" >&2; exit 1; }; }
need nbdcopy libnbd-bin; need nbdinfo libnbd-bin; need qemu-img qemu-utils; need fio fio
need ip iproute2; need tc iproute2; need mkfs.btrfs btrfs-progs; need mkfs.xfs xfsprogs; need curl curl; need jq jq
[ "$(id -u)" -eq 0 ] || { echo "bench/offload.sh needs root (netns, tc, loop devices)" >&2; exit 1; }

if [ "$BUILD" = 1 ]; then (cd "$REPO" && cargo build --release -p vouch >&2); fi
mkdir -p "$DIR" "$OUT"
: > "$OUT/samples.tsv"
TOKEN=$DIR/control.token
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$TOKEN"

PIDS=()
MNT=""
LOOPDEV=""
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    sleep 0.5
    for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del $NS_SRV 2>/dev/null || true
    ip netns del $NS_CLI 2>/dev/null || true
    if [ -n "$MNT" ]; then umount "$MNT" 2>/dev/null || true; fi
    if [ -n "$LOOPDEV" ]; then losetup -d "$LOOPDEV" 2>/dev/null || true; fi
    rm -rf "$DIR"/vol-* "$DIR/fs.img" "$DIR/mnt"
}
trap cleanup EXIT

now() { date +%s.%N; }
sample() { # test method rep seconds bytes
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$OUT/samples.tsv"
    printf '%-18s %-26s rep %s  %8.3f s  %8.1f MB/s\n' "$1" "$2" "$3" "$4" \
        "$(echo "$5 / $4 / 1000000" | bc -l)" >&2
}
timed() { # test method rep bytes -- command...
    local test=$1 method=$2 rep=$3 bytes=$4; shift 5
    local start end
    start=$(now); "$@" >/dev/null; end=$(now)
    sample "$test" "$method" "$rep" "$(echo "$end - $start" | bc -l)" "$bytes"
}
bytes_of() { numfmt --from=iec "$1"; }
BYTES=$(bytes_of "$SIZE")

# ---- data: one random raw image, imported into the volumes ----
RAW=$DIR/raw.img
if [ ! -f "$RAW" ] || [ "$(stat -c %s "$RAW")" != "$BYTES" ] || [ "$KEEP_RAW" != 1 ]; then
    echo "making $SIZE of random data" >&2
    head -c "$BYTES" /dev/urandom > "$RAW"
fi
make_volume() { # path
    rm -rf "$1"
    "$VOUCH" import "$RAW" "$1" >/dev/null
}
warm() { cat "$1"/data.* > /dev/null; }

# control API: POST a job and wait for it; fails unless it finished.
control_job() { # base_url json [curl prefix...]
    local base=$1 json=$2; shift 2
    local id state
    id=$("$@" curl -sS -f -H "Authorization: Bearer $(cat "$TOKEN")" -H 'content-type: application/json' \
        -d "$json" "$base/v1/jobs" | jq -r .id)
    state=queued
    while [ "$state" = queued ] || [ "$state" = running ]; do
        state=$("$@" curl -sS -f -H "Authorization: Bearer $(cat "$TOKEN")" "$base/v1/jobs/$id?wait=300" | jq -r .state)
    done
    [ "$state" = finished ] || { echo "job $json: $state" >&2; return 1; }
}

start_server() { # netns-or-"" nbd_addr control_addr volumes...
    local ns=$1 nbd=$2 control=$3; shift 3
    local prefix=()
    [ -n "$ns" ] && prefix=(ip netns exec "$ns")
    "${prefix[@]}" "$VOUCH" serve "$@" --listen "$nbd" --control "$control" \
        --control-token-file "$TOKEN" > "$OUT/server-$(date +%s%N).log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do
        "${prefix[@]}" nbdinfo --size "nbd://$nbd/" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "server on $nbd did not start" >&2; exit 1
}

setup_link() {
    ip netns add $NS_SRV; ip netns add $NS_CLI
    ip link add vob0 type veth peer name vob1
    ip link set vob0 netns $NS_SRV; ip link set vob1 netns $NS_CLI
    ip -n $NS_SRV addr add $SRV_IP/24 dev vob0; ip -n $NS_CLI addr add $CLI_IP/24 dev vob1
    for ns in $NS_SRV $NS_CLI; do ip -n $ns link set lo up; done
    ip -n $NS_SRV link set vob0 up; ip -n $NS_CLI link set vob1 up
    ip netns exec $NS_SRV tc qdisc add dev vob0 root tbf rate "$LINK_RATE" burst 4mb latency 10ms
    ip netns exec $NS_CLI tc qdisc add dev vob1 root tbf rate "$LINK_RATE" burst 4mb latency 10ms
}

has() { [[ " $TESTS " == *" $1 "* ]]; }

# ---- verify across the shaped link and on loopback ----
if has verify_link || has verify_loopback || has verify_digest; then
    make_volume "$DIR/vol-src"; warm "$DIR/vol-src"
    setup_link
    # One server, in the server namespace: the client namespace reaches it across the shaped veth;
    # a client inside the server namespace reaches the same address over that namespace's loopback.
    start_server $NS_SRV "$SRV_IP:$NBD_PORT" "$SRV_IP:$CONTROL_PORT" "$DIR/vol-src" --name src
    in_cli=(ip netns exec $NS_CLI)
    in_srv=(ip netns exec $NS_SRV)
    SEED=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
    for rep in $(seq "$REPS"); do
        if has verify_link; then
            timed verify_link nbdcopy_to_null "$rep" "$BYTES" -- "${in_cli[@]}" nbdcopy "nbd://$SRV_IP:$NBD_PORT/src" null:
            timed verify_link offload_api "$rep" "$BYTES" -- control_job "http://$SRV_IP:$CONTROL_PORT" \
                '{"op":"verify","export":"src"}' "${in_cli[@]}"
            timed verify_link offload_nbd_context "$rep" "$BYTES" -- "${in_cli[@]}" nbdinfo \
                --map=x-vouch:integrity "nbd://$SRV_IP:$NBD_PORT/src"
        fi
        if has verify_loopback; then
            timed verify_loopback nbdcopy_to_null "$rep" "$BYTES" -- "${in_srv[@]}" nbdcopy "nbd://$SRV_IP:$NBD_PORT/src" null:
            timed verify_loopback offload_api "$rep" "$BYTES" -- control_job "http://$SRV_IP:$CONTROL_PORT" \
                '{"op":"verify","export":"src"}' "${in_srv[@]}"
            timed verify_loopback offload_nbd_context "$rep" "$BYTES" -- "${in_srv[@]}" nbdinfo \
                --map=x-vouch:integrity "nbd://$SRV_IP:$NBD_PORT/src"
        fi
        if has verify_digest; then
            timed verify_digest no_seed "$rep" "$BYTES" -- control_job "http://$SRV_IP:$CONTROL_PORT" \
                '{"op":"verify","export":"src"}' "${in_srv[@]}"
            timed verify_digest seed_and_segments "$rep" "$BYTES" -- control_job "http://$SRV_IP:$CONTROL_PORT" \
                "{\"op\":\"verify\",\"export\":\"src\",\"seed\":\"$SEED\",\"segments\":true}" "${in_srv[@]}"
        fi
    done
    cleanup; PIDS=()
fi

# ---- scrub at full speed vs reading the data file; foreground I/O under a limited scrub ----
if has scrub || has scrub_foreground; then
    make_volume "$DIR/vol-src"; warm "$DIR/vol-src"
    start_server "" "127.0.0.1:$LOOP_NBD_PORT" "127.0.0.1:$LOOP_CONTROL_PORT" "$DIR/vol-src" --name src
    base="http://127.0.0.1:$LOOP_CONTROL_PORT"
    for rep in $(seq "$REPS"); do
        if has scrub; then
            warm "$DIR/vol-src"
            timed scrub dd_data_file "$rep" "$BYTES" -- dd if="$DIR/vol-src/data.00000" of=/dev/null bs=1M
            # A cancelled scrub's record would make the next one resume: start each from block 0.
            rm -f "$DIR/vol-src/scrub.json"
            timed scrub scrub_api "$rep" "$BYTES" -- control_job "$base" '{"op":"scrub","export":"src"}'
            if [ "$COLD" = 1 ]; then
                sync; echo 3 > /proc/sys/vm/drop_caches
                timed scrub dd_data_file_cold "$rep" "$BYTES" -- dd if="$DIR/vol-src/data.00000" of=/dev/null bs=1M
                sync; echo 3 > /proc/sys/vm/drop_caches
                rm -f "$DIR/vol-src/scrub.json"
                timed scrub scrub_api_cold "$rep" "$BYTES" -- control_job "$base" '{"op":"scrub","export":"src"}'
            fi
        fi
        if has scrub_foreground; then
            warm "$DIR/vol-src"
            fio_iops() {
                fio --ioengine=nbd --uri="nbd://127.0.0.1:$LOOP_NBD_PORT/src" --rw=randread --bs=4k --iodepth=1 \
                    --runtime=15 --time_based --norandommap --randrepeat=0 --name=fg --output-format=json \
                    --output="$OUT/fio-fg.json" >/dev/null
                jq '.jobs[0].read.iops' "$OUT/fio-fg.json"
            }
            alone=$(fio_iops)
            rate=$(bytes_of "$SCRUB_RATE")
            rm -f "$DIR/vol-src/scrub.json"
            id=$(curl -sS -f -H "Authorization: Bearer $(cat "$TOKEN")" -H 'content-type: application/json' \
                -d "{\"op\":\"scrub\",\"export\":\"src\",\"rate\":$rate}" "$base/v1/jobs" | jq -r .id)
            sleep 1
            during=$(fio_iops)
            state=$(curl -sS -f -H "Authorization: Bearer $(cat "$TOKEN")" "$base/v1/jobs/$id" | jq -r .state)
            curl -sS -f -X DELETE -H "Authorization: Bearer $(cat "$TOKEN")" "$base/v1/jobs/$id" >/dev/null || true
            [ "$state" = running ] || echo "warning: the scrub was $state when fio finished" >&2
            printf 'scrub_foreground\tiops_alone\t%s\t%s\t0\n' "$rep" "$alone" >> "$OUT/samples.tsv"
            printf 'scrub_foreground\tiops_during_scrub\t%s\t%s\t0\n' "$rep" "$during" >> "$OUT/samples.tsv"
            echo "scrub_foreground rep $rep: alone $alone IOPS, during scrub at $SCRUB_RATE/s $during IOPS" >&2
        fi
    done
    cleanup; PIDS=()
fi

# ---- copy between two exports of one server ----
copy_round() { # test dir method rep
    local test=$1 dir=$2 method=$3 rep=$4 base="http://127.0.0.1:$LOOP_CONTROL_PORT"
    local a="nbd://127.0.0.1:$LOOP_NBD_PORT/src" b="nbd://127.0.0.1:$LOOP_NBD_PORT/dst"
    # Each method starts with no dirty data left by the one before it
    # (its write-back would otherwise slow the next one's fsyncs and reads).
    sync
    timed "$test" nbdcopy "$rep" "$BYTES" -- nbdcopy "$a" "$b"
    sync
    timed "$test" qemu_img_convert "$rep" "$BYTES" -- qemu-img convert -n -f raw -O raw "$a" "$b"
    sync
    timed "$test" "offload_$method" "$rep" "$BYTES" -- control_job "$base" \
        "{\"op\":\"copy\",\"source\":{\"export\":\"src\",\"offset\":0},\"destination\":{\"export\":\"dst\",\"offset\":0},\"length\":$BYTES,\"method\":\"$method\"}"
    # The copy is right: the destination reads what the source does.
    qemu-img compare -f raw -F raw "$a" "$b" >/dev/null
}
if has copy; then
    make_volume "$DIR/vol-src"; make_volume "$DIR/vol-dst"; warm "$DIR/vol-src"
    start_server "" "127.0.0.1:$LOOP_NBD_PORT" "127.0.0.1:$LOOP_CONTROL_PORT" "$DIR/vol-src" "$DIR/vol-dst" --name src --name dst
    for rep in $(seq "$REPS"); do copy_round copy "$DIR" auto "$rep"; done
    cleanup; PIDS=()
fi
reflink_rounds() { # test mkfs...
    local test=$1; shift
    truncate -s $((BYTES * 5 + (4 << 30))) "$DIR/fs.img"
    "$@" "$DIR/fs.img"
    LOOPDEV=$(losetup -f --show "$DIR/fs.img")
    MNT=$DIR/mnt; mkdir -p "$MNT"; mount "$LOOPDEV" "$MNT"
    rm -rf "$MNT"/vol-*
    "$VOUCH" import "$RAW" "$MNT/vol-src" >/dev/null; "$VOUCH" import "$RAW" "$MNT/vol-dst" >/dev/null
    warm "$MNT/vol-src"
    start_server "" "127.0.0.1:$LOOP_NBD_PORT" "127.0.0.1:$LOOP_CONTROL_PORT" "$MNT/vol-src" "$MNT/vol-dst" --name src --name dst
    for rep in $(seq "$REPS"); do copy_round "$test" "$MNT" reflink "$rep"; done
    cleanup; PIDS=(); MNT=""; LOOPDEV=""
}
if has copy_reflink; then reflink_rounds copy_reflink mkfs.btrfs -q; fi
if has copy_reflink_xfs; then reflink_rounds copy_reflink_xfs mkfs.xfs -q -m reflink=1; fi

# ---- report: medians and ratios ----
{
    echo "# bench/offload.sh — $(date -u +%Y-%m-%dT%H:%MZ), SIZE=$SIZE REPS=$REPS LINK_RATE=$LINK_RATE"
    echo
    echo "| test | method | median s | median MB/s (IOPS for scrub_foreground) | vs first method |"
    echo "|---|---|---|---|---|"
    awk -F'\t' '
        { key = $1 "\t" $2; if (!(key in n)) { order[++k] = key } v[key, ++n[key]] = $4; b[key] = $5 }
        END {
            for (i = 1; i <= k; i++) {
                key = order[i]; m = n[key]
                for (x = 1; x <= m; x++) a[x] = v[key, x]
                for (x = 1; x <= m; x++) for (y = x + 1; y <= m; y++) if (a[y] < a[x]) { t = a[x]; a[x] = a[y]; a[y] = t }
                med = (m % 2) ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
                split(key, p, "\t")
                rate = (b[key] > 0) ? sprintf("%.0f", b[key] / med / 1e6) : sprintf("%.0f", med)
                if (!(p[1] in first)) { first[p[1]] = med; firstb[p[1]] = b[key] }
                if (b[key] > 0) ratio = sprintf("%.2fx", first[p[1]] / med)
                else ratio = sprintf("%.2fx", med / first[p[1]])
                printf "| %s | %s | %.3f | %s | %s |\n", p[1], p[2], (b[key] > 0 ? med : 0), rate, ratio
            }
        }' "$OUT/samples.tsv"
} > "$OUT/report.md"
cat "$OUT/report.md"
