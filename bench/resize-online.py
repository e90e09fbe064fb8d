# Used by bench/resize-online.sh.
# QD1 writer (4 KiB random writes, a flush every FLUSH_EVERY) against a
# served volume while `vouch resize --server` grows it once; prints the
# server's waited/held times, the resize's wall time, and the slowest
# write and flush during it against the median outside it.
import json, os, random, subprocess, sys, threading, time
import nbd
uri, vouch, control, blocks, size, flush_every = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
h = nbd.NBD(); h.connect_uri(uri)
writes, flushes, stop = [], [], threading.Event()
buf = os.urandom(4096)
def writer():
    i = 0
    while not stop.is_set():
        t = time.monotonic()
        h.pwrite(buf, random.randrange(blocks) * 4096)
        writes.append((t, time.monotonic()))
        i += 1
        if flush_every and i % flush_every == 0:
            t = time.monotonic()
            h.flush()
            flushes.append((t, time.monotonic()))
th = threading.Thread(target=writer); th.start()
time.sleep(1)
c = time.monotonic()
out = subprocess.run([vouch, "resize", "--server", control, size], capture_output=True, text=True, check=True)
r = time.monotonic()
time.sleep(1)
stop.set(); th.join()
waited = float(out.stdout.split("clients waited ")[1].split(" ms")[0])
held = float(out.stdout.split("then ")[1].split(" ms")[0])
def during(v): return [b - a for a, b in v if a < r and b > c]
def outside(v): return sorted(b - a for a, b in v if not (a < r and b > c))
w_out, f_out = outside(writes), outside(flushes)
print(json.dumps({
  "waited_ms": waited, "held_ms": held, "resize_wall_ms": (r - c) * 1e3,
  "slowest_write_during_ms": max(during(writes), default=0) * 1e3,
  "slowest_flush_during_ms": max(during(flushes), default=0) * 1e3,
  "write_ms_outside_median": w_out[len(w_out)//2] * 1e3 if w_out else None,
  "flush_ms_outside_median": f_out[len(f_out)//2] * 1e3 if f_out else None,
  "writes": len(writes), "flushes": len(flushes), "new_size": h.get_size()}))
