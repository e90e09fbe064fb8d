#!/usr/bin/env bash
# bench/first-touch.sh -- what a copy into fresh page cache costs on this machine, with the guest's
# free page reporting as it is and held (the reason bench/import.sh holds it).
# A producer process writes 8 MiB chunks into a 64 MiB shared tmpfs ring (as NBD payloads land); a
# consumer on the other CPU pwrite()s each chunk into a new file (the page cache's first touch), ROUNDS
# times per mode; prints the consumer's CPU seconds per GiB each time. Needs root for the hold.
# WRITE is the length of each pwrite (default 8M, as one commit's runs; the page cache sizes its folios
# by it, and with reporting on, writes of 1 MiB and more paid the host's faults where 256-512 KiB
# writes did not: compare WRITE=256K).
#   bench/first-touch.sh
#   ROUNDS=8 DIR=/var/tmp bench/first-touch.sh
#   WRITE=256K bench/first-touch.sh
set -uo pipefail
ROUNDS=${ROUNDS:-5}; DIR=${DIR:-/var/tmp}; WRITE=${WRITE:-8M}
REPORTING=/sys/module/page_reporting/parameters/page_reporting_order
copy() {
    python3 - "$DIR/first-touch.$$" "$WRITE" <<'PY'
import mmap, os, sys, time
dst = sys.argv[1]; chunk = 8 << 20; total = 1 << 30; ring = 64 << 20
units = {"K": 1 << 10, "M": 1 << 20}
write = int(sys.argv[2][:-1]) * units[sys.argv[2][-1].upper()] if sys.argv[2][-1].upper() in units else int(sys.argv[2])
assert 0 < write and chunk % write == 0, "WRITE must divide 8M"
src = "/dev/shm/first-touch.%d" % os.getpid()
fd = os.open(src, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600); os.ftruncate(fd, ring); os.unlink(src)
mm = mmap.mmap(fd, ring, mmap.MAP_SHARED); mv = memoryview(mm); mm[:] = b"\1" * ring
ready_r, ready_w = os.pipe(); done_r, done_w = os.pipe()
pattern = os.urandom(chunk)
if os.fork() == 0:
    os.sched_setaffinity(0, {0})
    for i in range(total // chunk):
        if i >= 4:
            os.read(done_r, 1)
        off = (i * chunk) % ring
        mv[off:off + chunk] = pattern
        os.write(ready_w, b"x")
    os._exit(0)
os.sched_setaffinity(0, {1 % os.cpu_count()})
out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
cpu = time.process_time()
for i in range(total // chunk):
    os.read(ready_r, 1)
    off = (i * chunk) % ring
    for at in range(0, chunk, write):
        os.pwritev(out, [mv[off + at:off + at + write]], i * chunk + at)
    os.write(done_w, b"y")
print("%.2f" % (time.process_time() - cpu))
os.wait(); os.close(out); os.unlink(dst)
PY
}
was=""
[ -w "$REPORTING" ] && was=$(cat "$REPORTING")
restore() { if [ -n "$was" ]; then echo "$was" > "$REPORTING"; fi; }
trap restore EXIT
row() { local label=$1 out=(); for _ in $(seq "$ROUNDS"); do out+=("$(copy)"); sync; done; echo "$label: ${out[*]} (CPU s per GiB, one per round)"; }
row "reporting as it is (order ${was:-none})"
if [ -n "$was" ]; then
    echo 11 > "$REPORTING"
    copy > /dev/null; sync   # the first round after the hold still meets pages reported before it
    row "reporting held (order 11)"
fi
