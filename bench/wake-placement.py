#!/usr/bin/env python3
"""perf script -i FILE | bench/wake-placement.py [A B] -- where the kernel woke two threads for each other.

FILE: `perf record -a -e sched:sched_switch -e sched:sched_waking -e sched:sched_wakeup`
(bench/qd1-probe.sh with SCHEDTRACE=FILE records it over its QD1 run and runs this script;
bench/fsync8-probe.sh with PERF=FILE PERFARGS="-e sched:sched_switch -e sched:sched_waking
-e sched:sched_wakeup -a"). A is the client, B the server's reactor (default fio and tokio).
For every wake-up of a thread whose name starts with A or B by the other, on a 2-CPU machine: what
the other CPU was running (idle, a realtime thread, CFS work), whether the wakee was placed on the
waker's CPU or the other, and the mean time from the wake-up to running. The placement is
sched_wakeup's CPU, chosen by the kernel; sched_waking's is the CPU the wakee last ran on, used
only when a trace has no sched_wakeup (older traces: they did not record where wakees went).

Then the request/reply cycles: one starts each time B wakes A (the reply) and ends at the next.
Each is classed by where A was woken and whether that CPU was idle (a halted vCPU on a VM, whose
wake-up costs an exit), and by how B left its CPU after the reply: it slept (reached its park,
epoll_wait, before the next request came) or was preempted (by A woken on its CPU: the next request
is then already there when B runs again, and no one is woken for it). With each class's share of
the cycles and its mean length, and what ran on the other CPU at the replies, by name.
"""
import collections
import re
import sys

names = tuple(sys.argv[1:3]) if len(sys.argv) > 2 else ("fio", "tokio")
client, server = names
event = re.compile(r"^\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
switch = re.compile(r"prev_pid=(\d+) .*prev_state=(\S+) ==> next_comm=(.+?) next_pid=(\d+) next_prio=(\d+)")
waking = re.compile(r"comm=(.+?) pid=(\d+) prio=(\d+) target_cpu=(\d+)")
lines = sys.stdin.readlines()
has_wakeup = any("sched:sched_wakeup:" in line for line in lines)
placed_by = "sched_wakeup" if has_wakeup else "sched_waking"
running = {}  # cpu -> (comm, prio)
pending = {}  # pid -> (time, key)
woken = {}  # pid -> (time, waker cpu, other CPU's kind, other CPU's comm, waker pid), until placed
count = collections.Counter()
latency = collections.defaultdict(list)
reply = None  # the reply's class, until the server's switch after it says how it left
cycle = None  # (start, class) of the cycle in progress
cycles = collections.Counter()
lengths = collections.defaultdict(float)
occupants = collections.Counter()
for line in lines:
    m = event.match(line)
    if not m:
        continue
    comm, pid, cpu, t, name, rest = m.groups()
    cpu, t = int(cpu), float(t)
    if name == "sched_switch":
        s = switch.search(rest)
        if not s:
            continue
        if reply is not None and int(s.group(1)) == reply["server"]:
            left = "preempted" if s.group(2).startswith("R") else "slept" if s.group(2) == "S" else s.group(2)
            key = (reply["where"], reply["idle"], left)
            if cycle is not None:
                cycles[cycle[1]] += 1
                lengths[cycle[1]] += reply["t"] - cycle[0]
            cycle = (reply["t"], key)
            reply = None
        running[cpu] = (s.group(3), int(s.group(5)))
        started = pending.pop(int(s.group(4)), None)
        if started:
            latency[started[1]].append((t - started[0]) * 1e6)
    elif name in ("sched_waking", "sched_wakeup"):
        w = waking.search(rest)
        if not w or not w.group(1).startswith(names) or not comm.strip().startswith(names):
            continue
        wakee = int(w.group(2))
        if name == "sched_waking":
            other_comm, other_prio = running.get(1 - cpu, ("?", 120))
            other = "idle" if other_comm.startswith("swapper") else ("realtime" if other_prio < 100 else "CFS")
            woken[wakee] = (t, cpu, other, other_comm, int(pid))
        if name != placed_by or wakee not in woken:
            continue
        at, waker_cpu, other, other_comm, waker = woken.pop(wakee)
        target = int(w.group(4))
        key = (other, "same CPU" if target == waker_cpu else "other CPU")
        count[key] += 1
        pending[wakee] = (at, key)
        if comm.strip().startswith(server) and w.group(1).startswith(client):
            idle = target != waker_cpu and running.get(target, ("swapper", 120))[0].startswith("swapper")
            reply = {"t": at, "server": waker, "where": key[1], "idle": "idle" if idle else "busy"}
            occupants[re.sub(r"\d+", "N", other_comm)] += 1
total = sum(count.values()) or 1
print(f"placement from {placed_by}")
for key, n in count.most_common():
    lat = latency[key]
    print(f"other CPU runs {key[0]:8} -> woken on {key[1]:9}: {n:6} ({100 * n / total:4.1f} %), "
          f"wake to run {sum(lat) / max(1, len(lat)):6.1f} us")
done = sum(cycles.values())
if done:
    print(f"{done} cycles ({server} wakes {client} to the next such wake):")
    for (where, idle, left), n in cycles.most_common():
        print(f"  {client} woken on {where:9} ({'idle' if idle == 'idle' else 'busy'}), {server} then {left:9}:"
              f" {n / done:.3f} of cycles, mean {lengths[(where, idle, left)] / n * 1e6:.1f} us")
    seen = sum(occupants.values())
    print("  the other CPU at the replies: " + ", ".join(f"{what} {n / seen:.3f}" for what, n in occupants.most_common(8)))
