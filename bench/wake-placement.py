#!/usr/bin/env python3
"""perf script -i FILE | bench/wake-placement.py [A B] -- where the kernel woke two threads for each other.

FILE: `perf record -a -e sched:sched_switch -e sched:sched_waking` (bench/fsync8-probe.sh with
PERF=FILE PERFARGS="-e sched:sched_switch -e sched:sched_waking -a"). For every wake-up of a thread
whose name starts with A or B (default fio and tokio: the client and the server's reactor) by the
other, on a 2-CPU machine: what the other CPU was running (idle, a realtime thread, CFS work), whether
the wakee was placed on the waker's CPU or the other, and the mean time from the wake-up to running.
"""
import collections
import re
import sys

names = tuple(sys.argv[1:3]) if len(sys.argv) > 2 else ("fio", "tokio")
event = re.compile(r"^\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
switch = re.compile(r"next_comm=(.+?) next_pid=(\d+) next_prio=(\d+)")
waking = re.compile(r"comm=(.+?) pid=(\d+) prio=(\d+) target_cpu=(\d+)")
running = {}  # cpu -> (comm, prio)
pending = {}  # pid -> (time, key)
count = collections.Counter()
latency = collections.defaultdict(list)
for line in sys.stdin:
    m = event.match(line)
    if not m:
        continue
    comm, _pid, cpu, t, name, rest = m.groups()
    cpu, t = int(cpu), float(t)
    if name == "sched_switch":
        s = switch.search(rest)
        if not s:
            continue
        running[cpu] = (s.group(1), int(s.group(3)))
        started = pending.pop(int(s.group(2)), None)
        if started:
            latency[started[1]].append((t - started[0]) * 1e6)
    elif name == "sched_waking":
        w = waking.search(rest)
        if not w or not w.group(1).startswith(names) or not comm.strip().startswith(names):
            continue
        other_comm, other_prio = running.get(1 - cpu, ("?", 120))
        other = "idle" if other_comm.startswith("swapper") else ("realtime" if other_prio < 100 else "CFS")
        key = (other, "same CPU" if int(w.group(4)) == cpu else "other CPU")
        count[key] += 1
        pending[int(w.group(2))] = (t, key)
total = sum(count.values()) or 1
for key, n in count.most_common():
    lat = latency[key]
    print(f"other CPU runs {key[0]:8} -> woken on {key[1]:9}: {n:6} ({100 * n / total:4.1f} %), "
          f"wake to run {sum(lat) / max(1, len(lat)):6.1f} us")
