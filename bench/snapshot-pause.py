# Used by bench/snapshot-pause.sh.
# QD1 writer (4 KiB random writes, no flush) against a served volume while
# `vouch snapshot create --server` runs N times; prints per-snapshot the
# longest write latency seen during the create and the server's held_ms,
# and the overall median / p99 of write latency inside and outside creates.
import json, os, random, subprocess, sys, threading, time
import nbd
uri, vouch, control, blocks, n, flush_every = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
h = nbd.NBD(); h.connect_uri(uri)
lat, stop = [], threading.Event()
buf = os.urandom(4096)
def writer():
    i = 0
    while not stop.is_set():
        t = time.monotonic()
        h.pwrite(buf, random.randrange(blocks) * 4096)
        i += 1
        if flush_every and i % flush_every == 0:
            h.flush()
        lat.append((t, time.monotonic()))
th = threading.Thread(target=writer); th.start()
time.sleep(1)
snaps = []
for k in range(n):
    c = time.monotonic()
    out = subprocess.run([vouch, "snapshot", "create", "--server", control, f"p{k}"], capture_output=True, text=True, check=True)
    r = time.monotonic()
    held = float(out.stdout.split("held at the flush point ")[1].split(" ms")[0])
    flush = float(out.stdout.split("of which flush ")[1].split(" ms")[0])
    snaps.append((c, r, held, flush))
    time.sleep(0.5)
stop.set(); th.join()
def pct(v, p): v = sorted(v); return v[min(len(v)-1, int(len(v)*p))]
inside, outside, worst = [], [], []
for (c, r, held, _) in snaps:
    w = [b - a for a, b in lat if a < r and b > c]
    inside += w
    worst.append(max(w) * 1e3 if w else 0)
outside = [b - a for a, b in lat if not any(a < r and b > c for c, r, _, _ in snaps)]
print(json.dumps({
  "held_ms_median": pct([s[2] for s in snaps], .5), "held_ms_p99": pct([s[2] for s in snaps], .99),
  "create_ms_median": pct([(s[1]-s[0])*1e3 for s in snaps], .5),
  "worst_write_during_create_ms_median": pct(worst, .5), "worst_write_during_create_ms_p99": pct(worst, .99),
  "write_ms_during_creates_median": pct(inside, .5)*1e3, "write_ms_during_creates_p99": pct(inside, .99)*1e3,
  "write_ms_outside_median": pct(outside, .5)*1e3, "write_ms_outside_p99": pct(outside, .99)*1e3,
  "held_ms_each": [round(s[2],1) for s in snaps], "flush_ms_each": [round(s[3],1) for s in snaps], "writes": len(lat), "snapshots": len(snaps)}))
