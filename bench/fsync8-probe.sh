#!/usr/bin/env bash
# bench/fsync8-probe.sh -- one write+flush-every-8 run against a fresh vouch volume (or qemu-nbd), with the
# server's counts around it: the quick look behind bench/nbd.sh's rw4k_fsync8 (docs/BENCHMARKS.md, stop 34).
#
#   bench/fsync8-probe.sh PREFILL_BIN SERVE_BIN [PORT]
#
# A fresh 1 GiB split volume (DIR/vol) is created and prefilled (fio 1 MiB sequential writes, QD8) by
# PREFILL_BIN serving it; when SERVE_BIN differs (or RESTART=1) that server is stopped with SIGTERM and
# SERVE_BIN serves the same volume, the page cache kept: the state a prefill leaves is then separated from
# the binary that serves the test. "qemu" for both runs qemu-nbd --cache=writeback on a raw file instead.
# Then fio --rw=randwrite --bs=4k --iodepth=1 --fsync=8 for RUNTIME s. One line out:
#   iops, ios, server CPU per write (us), fio write and flush latency (us), the server's NBD metrics over
#   the run (requests, inline requests, engine latency per write and per flush), then perf stat syscall
#   counts (or nothing with PERF=).
# Knobs (environment):
#   SCHED      command prefix for the servers and fio, e.g. "chrt -f 10", "nice -n -10" (default none)
#   SRVSCHED / FIOSCHED  override SCHED for the servers / for fio alone
#   RUNTIME    seconds of the measured run (4)     DIR  scratch directory (/var/tmp/fsync8-probe-PORT)
#   RESTART=1  restart even when both binaries are the same   DROP=1  drop caches after the prefill
#   SERVE_ARGS more `vouch serve` arguments (e.g. --direct), given to both servers
#   PERF=FILE  perf record into FILE instead of perf stat; PERFARGS its events
#              (default "-e cpu-clock -g -p <server>"; e.g. "-e sched:sched_switch -e sched:sched_waking
#              -e sched:sched_wakeup -a" for bench/wake-placement.py)
set -u
PRE=$1 RUN=$2 PORT=${3:-12900}
SCHED=${SCHED:-} SRV=${SRVSCHED-$SCHED} FS=${FIOSCHED-$SCHED}
RUNTIME=${RUNTIME:-4} DIR=${DIR:-/var/tmp/fsync8-probe-$PORT}
MPORT=$((PORT + 100))
P="" S=""
cleanup() { [ -n "$S" ] && kill -INT "$S" 2>/dev/null; [ -n "$P" ] && { kill -TERM "$P" 2>/dev/null; wait "$P" 2>/dev/null; }; rm -rf "$DIR"; }
trap cleanup EXIT
rm -rf "$DIR"; mkdir -p "$DIR"
start() { # BIN [EXTRA ARGS]: serve the volume, wait for the port
    local bin=$1; shift
    if [ "$bin" = qemu ]; then
        [ -f "$DIR/raw" ] || truncate -s 1G "$DIR/raw"
        $SRV qemu-nbd -f raw -t -e 8 --cache=writeback --aio=threads -b 127.0.0.1 -p "$PORT" "$DIR/raw" >>"$DIR/log" 2>&1 &
    else
        $SRV "$bin" serve "$DIR/vol" "$@" ${SERVE_ARGS:-} --listen "127.0.0.1:$PORT" --metrics "127.0.0.1:$MPORT" >>"$DIR/log" 2>&1 &
    fi
    P=$!
    for _ in $(seq 100); do nbdinfo --size "nbd://127.0.0.1:$PORT" >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "server did not listen: $(tail -3 "$DIR/log")" >&2; exit 1
}
stop() { kill -TERM "$P"; wait "$P" 2>/dev/null; P=""; }
metrics() { # requests, inline requests and latency sums of writes and flushes, as key=value
    curl -s --max-time 2 "127.0.0.1:$MPORT/metrics" 2>/dev/null | grep -E '^vouch_nbd_(inline_requests_total|requests_total|request_latency_seconds_sum)\{[^}]*command="(write|flush)"' \
        | sed 's/^vouch_nbd_\([a-z_]*\){.*command="\([a-z]*\)".*} /\1_\2=/' | tr '\n' ' '
}
start "$PRE" --create 1G
$FS fio --name=prefill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT" --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null 2>&1
if [ "$PRE" != "$RUN" ] || [ -n "${RESTART:-}" ]; then stop; start "$RUN"; fi
[ -n "${DROP:-}" ] && { sync; echo 3 > /proc/sys/vm/drop_caches; }
M0=$(metrics); read -r U0 S0 < <(awk '{print $14, $15}' "/proc/$P/stat")
if [ -n "${PERF:-}" ]; then
    perf record ${PERFARGS:--e cpu-clock -g -p $P} -o "$PERF" >/dev/null 2>&1 & S=$!
else
    perf stat -e 'syscalls:sys_enter_pwrite64,syscalls:sys_enter_pwritev,syscalls:sys_enter_fdatasync,syscalls:sys_enter_futex,context-switches' \
        -p "$P" -o "$DIR/stat" 2>/dev/null & S=$!
fi
$FS fio --name=fsync8 --ioengine=nbd --uri="nbd://127.0.0.1:$PORT" --rw=randwrite --bs=4k --iodepth=1 --fsync=8 \
    --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json --output="$DIR/fio.json" >/dev/null 2>&1
kill -INT "$S"; wait "$S" 2>/dev/null; S=""
read -r U1 S1 < <(awk '{print $14, $15}' "/proc/$P/stat")
M1=$(metrics)
python3 - "$DIR/fio.json" "$((U1 - U0 + S1 - S0))" "$(getconf CLK_TCK)" "$M0" "$M1" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
w, s = j["write"], j["sync"]
ios = w["total_ios"]
parse = lambda t: {k: float(v) for k, v in (kv.split("=") for kv in t.split())}
m0, m1 = parse(sys.argv[4]), parse(sys.argv[5])
d = {k: v - m0.get(k, 0) for k, v in m1.items()}
per = lambda k, n: round(d.get(k, 0) * 1e6 / max(1, d.get(n, 0)), 1)
out = [f"iops {round(w['iops'])}", f"ios {ios}",
       f"server_cpu_us/write {round(int(sys.argv[2]) / int(sys.argv[3]) * 1e6 / max(1, ios), 1)}",
       f"fio_write_us {round(w['lat_ns']['mean'] / 1e3, 1)}", f"fio_flush_us {round(s['lat_ns']['mean'] / 1e3, 1)}"]
if d:
    out += [f"{k}={int(v)}" for k, v in sorted(d.items()) if "latency" not in k]
    out += [f"engine_write_us {per('request_latency_seconds_sum_write', 'requests_total_write')}",
            f"engine_flush_us {per('request_latency_seconds_sum_flush', 'requests_total_flush')}"]
print(" ".join(out))
PY
[ -z "${PERF:-}" ] && awk '/syscalls|context/ {printf "%s=%s ", $2, $1} END {print ""}' "$DIR/stat" | sed 's/syscalls:sys_enter_//g'
exit 0
