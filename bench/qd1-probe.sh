#!/usr/bin/env bash
# bench/qd1-probe.sh -- 4 KiB random writes at QD1 through the page cache over a prefilled vouch volume,
# with the server's CPU per write: the quick look behind bench/nbd.sh's rw4k_qd1 (issue 29).
#
#   BIN=/work/bin/vouch-x [PREFILL_BIN=/work/bin/vouch-y] [PORT=12950] bench/qd1-probe.sh
#
# A fresh 1 GiB split volume (DIR/vol) is created and prefilled (fio 1 MiB sequential writes, QD8,
# over all of it) by PREFILL_BIN (default BIN) serving it; when PREFILL_BIN differs from BIN (or
# RESTART=1) that server is stopped with SIGTERM and BIN serves the same volume, the page cache kept:
# the state a prefill leaves is then separated from the binary that serves the test. Then fio
# --rw=randwrite --bs=4k --iodepth=1 for RUNTIME s, no flushes. One line out:
#   iops, ios, server CPU per write (us), the server's minor faults and context switches (voluntary,
#   involuntary, all threads) per write, the extent count of the volume's data files after the prefill
#   (filefrag), /proc/vmstat's nr_written and pgpgout (KiB) and the machine's idle CPU (%) over the
#   run. Counts per write hold on a busy machine where IOPS and CPU time do not; but at QD1 a quiet
#   machine is another regime, not a less noisy one (docs/BENCHMARKS.md, "qd29"): say how idle it was.
# Knobs (environment):
#   SCHED     command prefix for the servers and fio, e.g. "nice -n -10" (default none)
#   CLIENT_SCHED  the same for the QD1 fio alone (default SCHED), e.g. another CPU by taskset
#   RUNTIME   seconds of the measured run (4)    DIR  scratch directory (/var/tmp/qd1-probe-PORT)
#   SIZE      volume size (1G)                   SERVE_ARGS  more `vouch serve` arguments
#   SYNC=1    sync after the prefill (the data written back before the run)
#   PERFSTAT=EVENTS  perf stat -e EVENTS -p <server> over the run; each event's count per write is
#             appended (e.g. "kmem:mm_page_alloc,kmem:mm_page_alloc_zone_locked,kmem:mm_page_alloc_extfrag")
#   PERF=FILE perf record -g of the server over the run into FILE (PERFARGS: its events)
#   HOLD_REPORTING=1  raise the guest's page_reporting_order to 11 for the run (nothing freed is handed
#             back to the host; restored at exit) after touching 2 GiB once, as bench/import.sh does:
#             separates what free page reporting costs from what the page cache's folios cost (root)
#   THREADS=1 also print, to stderr, each server thread's voluntary / involuntary context switches
#             and CPU (us) per write over the run, threads grouped by name (THREADS_BY_TID=1: one by one)
#   RAMP_TIME=S  fio's --ramp_time: the first S seconds of the QD1 run are left out of every count
#   SCHEDTRACE=FILE  perf record -a of the scheduler's switches and wake-ups over the run into FILE,
#             then bench/wake-placement.py of it to stderr: fio's and the reactor's wake-ups of each
#             other by placement (the waker's CPU, the other CPU idle or busy) and how each left its
#             CPU (slept, preempted by the other), per request
#   KEEPER=CPU  a nice 19 busy loop pinned to CPU over the run, so that CPU is never idle (a test of
#             the idle-vCPU wake-up cost: the QD1 pair then shares the other CPU)
#   HALTPOLL=NS  the guest's cpuidle haltpoll guest_halt_poll_ns for the run (an idle vCPU polls NS
#             before it halts; restored at exit; root)
#   FOLIOS=1  print bench/folio-sizes.py of the data files after the prefill (root)
#   REFOLIO=N after the prefill, stop the server, drop the data files from the page cache and write
#             their own bytes back in buffered writes of N bytes (e.g. 262144, 2097152): the same
#             bytes and on-disk extents in folios of another size (then BIN serves the volume)
set -u
BIN=${BIN:?BIN=path of the vouch binary that serves the run}
PRE=${PREFILL_BIN:-$BIN} PORT=${PORT:-12950}
SCHED=${SCHED:-} RUNTIME=${RUNTIME:-4} SIZE=${SIZE:-1G} DIR=${DIR:-/var/tmp/qd1-probe-$PORT}
MPORT=$((PORT + 100))
HERE=$(cd "$(dirname "$0")" && pwd)
P="" S="" K="" FIO="" REPORTING=/sys/module/page_reporting/parameters/page_reporting_order REPORTING_WAS=""
HALTPOLL_NS=/sys/module/haltpoll/parameters/guest_halt_poll_ns HALTPOLL_WAS=""
cleanup() {
    [ -n "$FIO" ] && kill "$FIO" 2>/dev/null; [ -n "$K" ] && kill "$K" 2>/dev/null
    [ -n "$S" ] && kill -INT "$S" 2>/dev/null; [ -n "$P" ] && { kill -TERM "$P" 2>/dev/null; wait "$P" 2>/dev/null; }; rm -rf "$DIR"
    [ -n "$REPORTING_WAS" ] && echo "$REPORTING_WAS" > "$REPORTING"
    [ -n "$HALTPOLL_WAS" ] && echo "$HALTPOLL_WAS" > "$HALTPOLL_NS"
}
trap cleanup EXIT
if [ -n "${SCHEDTRACE:-}${PERF:-}${PERFSTAT:-}" ] && ! command -v perf >/dev/null; then
    echo "PERF, PERFSTAT and SCHEDTRACE need perf: apt-get install linux-perf" >&2; exit 1
fi
if [ -n "${KEEPER:-}" ] && ! command -v taskset >/dev/null; then
    echo "KEEPER needs taskset: apt-get install util-linux" >&2; exit 1
fi
if [ -n "${HALTPOLL:-}" ] && [ ! -w "$HALTPOLL_NS" ]; then
    echo "HALTPOLL: $HALTPOLL_NS is not writable (root, cpuidle-haltpoll)" >&2; exit 1
fi
rm -rf "$DIR"; mkdir -p "$DIR"
if [ -n "${HOLD_REPORTING:-}" ] && [ -w "$REPORTING" ]; then
    REPORTING_WAS=$(cat "$REPORTING"); echo 11 > "$REPORTING"
    fio --name=warm --directory="$DIR" --size=2G --rw=write --bs=1M --output=/dev/null >/dev/null 2>&1
    rm -f "$DIR"/warm*
fi
start() { # BIN [EXTRA ARGS]: serve the volume, wait for the port
    local bin=$1; shift
    $SCHED "$bin" serve "$DIR/vol" "$@" ${SERVE_ARGS:-} --listen "127.0.0.1:$PORT" --metrics "127.0.0.1:$MPORT" >>"$DIR/log" 2>&1 &
    P=$!
    for _ in $(seq 100); do nbdinfo --size "nbd://127.0.0.1:$PORT" >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "server did not listen: $(tail -3 "$DIR/log")" >&2; exit 1
}
stop() { kill -TERM "$P"; wait "$P" 2>/dev/null; P=""; }
vmstat() { awk '$1 == "nr_written" || $1 == "pgpgout" { printf "%s ", $2 }' /proc/vmstat; }
data_files() { find "$DIR/vol" -type f -name 'data.*'; }
start "$PRE" --create "$SIZE"
$SCHED fio --name=prefill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT" --rw=write --bs=1M --iodepth=8 --size="$SIZE" >/dev/null 2>&1
if [ -n "${REFOLIO:-}" ]; then
    stop
    REWRITE=$(cat <<'PY'
import mmap, os, sys
chunk = int(sys.argv[1])
for path in sys.argv[2:]:
    fd = os.open(path, os.O_RDWR)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk)
    size = os.fstat(fd).st_size
    for at in range(0, size, chunk):
        n = os.preadv(direct, [buf], at)
        os.pwrite(fd, buf[:n], at)
    os.close(direct); os.close(fd)
PY
)
    data_files | xargs -r python3 -c "$REWRITE" "$REFOLIO"
    start "$BIN"
elif [ "$PRE" != "$BIN" ] || [ -n "${RESTART:-}" ]; then stop; start "$BIN"; fi
[ -n "${SYNC:-}" ] && sync
EXTENTS=$(data_files | xargs -r filefrag | awk '{ n += $2 } END { print n + 0 }')
[ -n "${FOLIOS:-}" ] && data_files | xargs -r python3 "$HERE/folio-sizes.py" >&2
idle() { awk '$1 == "cpu" { print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9 }' /proc/stat; } # idle+iowait, all
per_thread() { # name tid voluntary involuntary CPU, one line per thread of the server (a thread that
    # ends during the run takes its counts with it, so the totals are summed over these, by thread)
    for t in /proc/"$P"/task/*; do
        printf "%s %s " "$(tr " " _ < "$t/comm")${THREADS_BY_TID:+.${t##*/}}" "${t##*/}"
        awk '/^voluntary_ctxt/ { v = $2 } /^nonvoluntary_ctxt/ { n = $2 } END { printf "%s %s ", v, n }' "$t/status"
        sed 's/.*) //' "$t/stat" | awk '{ print $12 + $13 }' # utime + stime (ticks), after the name
    done
}
RAMP=${RAMP_TIME:-0}
if [ -n "${KEEPER:-}" ]; then
    nice -n 19 taskset -c "$KEEPER" sh -c 'while :; do :; done' & K=$!
fi
if [ -n "${HALTPOLL:-}" ]; then
    HALTPOLL_WAS=$(cat "$HALTPOLL_NS"); echo "$HALTPOLL" > "$HALTPOLL_NS"
fi
begin() { # the counts at the start of the measured run, and the recorders over it
    read -r W0 O0 < <(vmstat)
    read -r I0 T0 < <(idle)
    per_thread > "$DIR/threads0"
    F0=$(awk '{print $10}' "/proc/$P/stat") # minor faults
    read -r U0 S0 < <(awk '{print $14, $15}' "/proc/$P/stat")
    if [ -n "${PERF:-}" ]; then
        perf record ${PERFARGS:--e cpu-clock -g} -p "$P" -o "$PERF" >/dev/null 2>&1 & S=$!
    elif [ -n "${PERFSTAT:-}" ]; then
        perf stat -x, -e "$PERFSTAT" -p "$P" -o "$DIR/stat" >/dev/null 2>&1 & S=$!
    elif [ -n "${SCHEDTRACE:-}" ]; then
        perf record -a -e sched:sched_switch,sched:sched_waking,sched:sched_wakeup -o "$SCHEDTRACE" >/dev/null 2>&1 & S=$!
    fi
}
[ "$RAMP" = 0 ] && begin
# fio's --ramp_time runs first and is left out of its counts; the server's counts start after it too
${CLIENT_SCHED:-$SCHED} fio --name=qd1 --ioengine=nbd --uri="nbd://127.0.0.1:$PORT" --rw=randwrite --bs=4k --iodepth=1 \
    --time_based --runtime="$RUNTIME" --ramp_time="$RAMP" --norandommap --randrepeat=0 --output-format=json \
    --output="$DIR/fio.json" >/dev/null 2>&1 & FIO=$!
[ "$RAMP" != 0 ] && { sleep "$RAMP"; begin; }
wait "$FIO"; FIO=""
[ -n "$S" ] && { kill -INT "$S"; wait "$S" 2>/dev/null; S=""; }
read -r U1 S1 < <(awk '{print $14, $15}' "/proc/$P/stat")
F1=$(awk '{print $10}' "/proc/$P/stat")
per_thread > "$DIR/threads1"
read -r W1 O1 < <(vmstat)
read -r I1 T1 < <(idle)
python3 - "$DIR/fio.json" "$((U1 - U0))" "$((S1 - S0))" "$(getconf CLK_TCK)" "$EXTENTS" "$((W1 - W0))" "$((O1 - O0))" "$((F1 - F0))" "${THREADS:-}" "$DIR/stat" "$(( 100 * (I1 - I0) / (T1 - T0 > 0 ? T1 - T0 : 1) ))" "$DIR/threads0" "$DIR/threads1" <<'PY'
import json, sys
w = json.load(open(sys.argv[1]))["jobs"][0]["write"]
ios = max(1, w["total_ios"])
user, sys_, hz = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
per = lambda ticks: round(ticks / hz * 1e6 / ios, 1)
before = {}
for line in open(sys.argv[12]):
    name, tid, v, n, cpu = line.split()
    before[tid] = (int(v), int(n), int(cpu))
groups = {}
for line in open(sys.argv[13]):
    name, tid, v, n, cpu = line.split()
    v0, n0, c0 = before.get(tid, (0, 0, 0))
    g = groups.setdefault(name, [0, 0, 0, 0])
    g[0] += 1; g[1] += int(v) - v0; g[2] += int(n) - n0; g[3] += int(cpu) - c0
vcsw = sum(g[1] for g in groups.values())
ivcsw = sum(g[2] for g in groups.values())
print(f"iops {round(w['iops'])} ios {w['total_ios']} server_cpu_us/write {per(user + sys_)}"
      f" (user {per(user)} sys {per(sys_)})"
      + "".join(f" {name}/write {round(count / ios, 2)}" for name, count in
                (("minflt", int(sys.argv[8])), ("vcsw", vcsw), ("ivcsw", ivcsw)))
      + f" extents {sys.argv[5]}"
      f" nr_written_pages {sys.argv[6]} pgpgout_KiB {sys.argv[7]} machine_idle% {sys.argv[11]}", end="")
try:
    for line in open(sys.argv[10]):
        f = line.strip().split(",")
        if len(f) > 2 and f[0].replace(".", "").isdigit():
            print(f" {f[2]}/write {round(float(f[0]) / ios, 3)}", end="")
except OSError:
    pass
print(flush=True)
if sys.argv[9]:
    print("threads (vcsw/ivcsw/cpu_us per write): " + " ".join(
        f"{name}x{c} {round(v / ios, 3)}/{round(n / ios, 3)}/{per(cpu)}"
        for name, (c, v, n, cpu) in sorted(groups.items(), key=lambda kv: -kv[1][1]) if v or n or cpu), file=sys.stderr)
PY
if [ -n "${SCHEDTRACE:-}" ]; then
    perf script -i "$SCHEDTRACE" -F comm,tid,cpu,time,event,trace 2>/dev/null | python3 "$HERE/wake-placement.py" fio tokio >&2
fi
