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

Then, per request (a trace's window is not the client's: perf -a starts and stops late; a request
is counted here where A wakes B, or where B was preempted by A and so needed no wake-up to find
it): each direction's wake-ups by placement (the waker's CPU; the other CPU, idle or busy:
an idle vCPU on a VM halts, and its wake-up costs an exit) and how each thread left its CPU (slept,
or was preempted by the other: the one preempted then finds the other's message already there and
needs no wake-up). At QD1 every write takes at least one switch; what costs is the idle wake-ups.
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
wakes = collections.Counter()  # (waker, wakee, placement)
leaves = collections.Counter()  # (thread, slept / preempted by the other / otherwise)
occupants = collections.Counter()  # what the other CPU ran at each wake-up
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
        prev = comm.strip()
        if prev.startswith(names):
            who = client if prev.startswith(client) else server
            if s.group(2) == "S":
                left = "slept"
            elif s.group(2).startswith("R") and s.group(3).startswith(names) and not s.group(3).startswith(who):
                left = "preempted by the other"
            else:
                left = "otherwise"
            leaves[(who, left)] += 1
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
        waker_name = client if comm.strip().startswith(client) else server
        wakee_name = client if w.group(1).startswith(client) else server
        if target == waker_cpu:
            where = "on the waker's CPU"
        elif other == "idle":
            where = "on the other CPU, idle"
        else:
            where = "on the other CPU, busy"
        wakes[(waker_name, wakee_name, where)] += 1
        occupants[re.sub(r"\d+", "N", other_comm)] += 1
total = sum(count.values()) or 1
print(f"placement from {placed_by}")
for key, n in count.most_common():
    lat = latency[key]
    print(f"other CPU runs {key[0]:8} -> woken on {key[1]:9}: {n:6} ({100 * n / total:4.1f} %), "
          f"wake to run {sum(lat) / max(1, len(lat)):6.1f} us")
unit = sum(n for (waker, wakee, _), n in wakes.items() if (waker, wakee) == (client, server))
unit += leaves[(server, "preempted by the other")]
if unit:
    print(f"per request ({unit} seen):")
    for (waker, wakee, where), n in sorted(wakes.items()):
        print(f"  {f'{waker} wakes {wakee} {where}':50}: {n / unit:.3f}")
    for (who, left), n in sorted(leaves.items()):
        print(f"  {f'{who} {left}':50}: {n / unit:.3f}")
    seen = sum(occupants.values())
    print("  the other CPU at the wake-ups: " + ", ".join(f"{what} {n / seen:.3f}" for what, n in occupants.most_common(8)))
