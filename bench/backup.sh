#!/usr/bin/env bash
# bench/backup.sh -- incremental backup through qemu:dirty-bitmap (issue 33): a SIZE volume (default
# 1G) filled with random data, snapshot s1 (--copy: any filesystem), the previous full copy exported
# from s1; then 1 % of the blocks changed through NBD (single-block writes, two short trims, two zeroed
# runs, one whole metadata unit trimmed) and the backup: libnbd asks qemu:dirty-bitmap:s1 for the
# whole export and reads only the dirty ranges into the copy. Prints the bytes read (the criterion:
# <= 2 % of the volume), the time of the bitmap query and of the whole backup, and whether the copy
# then equals `vouch export` of the volume. Knobs: VOUCH (binary), DIR (scratch, removed first), SIZE,
# LAYOUT (split|packed), PORT.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
V=${VOUCH:-$REPO/target/release/vouch}
D=${DIR:-/var/tmp/vouch-backup-bench}; rm -rf "$D"; mkdir -p "$D"
SIZE=${SIZE:-1G}; LAYOUT=${LAYOUT:-split}; PORT=${PORT:-10833}
UNIT=128; [ "$LAYOUT" = packed ] && UNIT=31
$V create $D/vol --size "$SIZE" --layout "$LAYOUT" >/dev/null
# serve LOG: start the server and wait for its pid file (written once it listens).
serve() {
  rm -f $D/pid; $V serve $D/vol --listen 127.0.0.1:$PORT --pid-file $D/pid 2>$D/$1.log & P=$!
  for _ in $(seq 1200); do
    [ -s $D/pid ] && return 0
    kill -0 $P 2>/dev/null || { cat $D/$1.log; exit 1; }
    sleep 0.05
  done
  echo "serve did not start in 60 s"; exit 1
}
serve s1
/usr/bin/python3 - "nbd://127.0.0.1:$PORT" <<'PY'
import os, sys, nbd
h = nbd.NBD(); h.connect_uri(sys.argv[1]); size = h.get_size(); step = 4 << 20
for at in range(0, size, step): h.pwrite(os.urandom(step), at)
h.flush()
PY
kill $P; wait $P || true
$V snapshot create $D/vol s1 --copy >/dev/null
$V export $D/vol/snapshots/s1 $D/copy.raw
serve s2
/usr/bin/python3 - "nbd://127.0.0.1:$PORT" "$UNIT" <<'PY'
import os, random, sys, nbd
h = nbd.NBD(); h.connect_uri(sys.argv[1]); unit = int(sys.argv[2]); rng = random.Random(33)
blocks = h.get_size() // 4096; changed = set()
first = (blocks // 3) // unit * unit; h.trim(unit * 4096, first * 4096); changed.update(range(first, first + unit))
for kind, count in [("trim", 8), ("trim", 5), ("zero", 8), ("zero", 6)]:
    at = rng.randrange(0, blocks - count)
    (h.trim if kind == "trim" else h.zero)(count * 4096, at * 4096); changed.update(range(at, at + count))
while len(changed) < blocks // 100:
    lba = rng.randrange(0, blocks); h.pwrite(os.urandom(4096), lba * 4096); changed.add(lba)
h.flush()
print(f"changed {len(changed)} of {blocks} blocks ({len(changed) * 100 / blocks:.2f} %)")
PY
/usr/bin/python3 - "nbd://127.0.0.1:$PORT" "$D/copy.raw" <<'PY'
import sys, time, nbd
context = "qemu:dirty-bitmap:s1"
h = nbd.NBD(); h.add_meta_context(context); h.connect_uri(sys.argv[1]); size = h.get_size()
dirty, pos = [], [0]
def cb(meta, offset, entries, err):
    if meta != context: return 0
    at = offset
    for i in range(0, len(entries), 2):
        if entries[i + 1] & 1:
            if dirty and dirty[-1][0] + dirty[-1][1] == at: dirty[-1][1] += entries[i]
            else: dirty.append([at, entries[i]])
        at += entries[i]
    pos[0] = at; return 0
t0 = time.monotonic(); at = 0
while at < size:
    h.block_status(min(size - at, 1 << 30), at, cb); at = pos[0]
t1 = time.monotonic(); read = 0
with open(sys.argv[2], "r+b") as f:
    for at, length in dirty:
        data = h.pread(length, at); read += len(data); f.seek(at); f.write(data)
t2 = time.monotonic()
print(f"dirty ranges {len(dirty)}; read {read} of {size} bytes ({read * 100 / size:.2f} %); bitmap query {t1 - t0:.3f} s; backup {t2 - t0:.3f} s")
PY
# qemu's nbd driver reads the bitmap extent by extent (x-dirty-bitmap).
OPTS="driver=nbd,server.type=inet,server.host=127.0.0.1,server.port=$PORT,x-dirty-bitmap=qemu:dirty-bitmap:s1"
t0=$(date +%s.%N); EXTENTS=$(qemu-img map --output=json --image-opts "$OPTS" | grep -c '"start"'); t1=$(date +%s.%N)
echo "qemu-img map x-dirty-bitmap: $EXTENTS extents in $(echo "$t1 - $t0" | bc) s"
kill $P; wait $P || true
$V export $D/vol $D/now.raw
cmp -s $D/copy.raw $D/now.raw && echo "copy equals the volume" || { echo "copy DIFFERS from the volume"; exit 1; }
$V diff $D/vol/snapshots/s1 > $D/diff.txt; head -1 $D/diff.txt
rm -rf "$D"
