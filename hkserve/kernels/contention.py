"""Fewer kernel threads while other processes keep this machine's cores busy.

Why: each kernel call splits its work over XLA's intra-op pool, one thread per core. When another
process holds a core, the helper that shares it runs late or not at all, so the call costs a second
thread's overhead and still finishes on the calling thread's speed, less a share of its core. On
the 2-vCPU AMD EPYC VM, SmolLM2 int8 batch-1 decode with one core kept busy by a spin loop: the
pool quiet 189, loaded 136 tok/s; the calling thread alone 166 / 163 (kernels/README.md). So a
daemon thread measures, every quarter second, the CPU time that other processes spent on the cores
this process may run on (/proc/stat of those cores minus this process's own time from
/proc/self/stat, steal time counted as theirs) and caps the threads of calls that leave their count
to the pool at the cores left free. Quiet, the cap is off and batch 1 keeps both cores.

The cap changes only after two samples agree, so one burst of another process does not move it.
Threads never change a result (each output is the same instruction sequence on any thread).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("hkserve.kernels")
INTERVAL_S = 0.25
SLACK = 0.35  # others' busy share of a core that still leaves it to us: 0.65 of a core busy takes it


class CpuSample(NamedTuple):
    busy: int  # clock ticks the monitored cores spent not idle (steal included)
    own: int  # clock ticks this process ran (user + system, every thread)
    at: float  # seconds (time.monotonic)


def read_sample(
    cores: frozenset[int], proc: Path = Path("/proc"), clock: Callable[[], float] = time.monotonic
) -> CpuSample:
    """Busy ticks of `cores` (/proc/stat's cpuN lines) and this process's ticks, now."""
    busy = 0
    for line in (proc / "stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            # user nice system idle iowait irq softirq steal (guest time is inside user)
            ticks = [int(f) for f in fields[:8]]
            busy += sum(ticks) - ticks[3] - ticks[4]
    # /proc/self/stat: fields after the ")" that ends the command name; utime, stime are 14 and 15
    own = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
    return CpuSample(busy, int(own[11]) + int(own[12]), clock())


def others_busy(before: CpuSample, after: CpuSample, ticks_per_s: float) -> float:
    """Cores' worth of CPU time other processes used between two samples."""
    seconds = after.at - before.at
    if seconds <= 0:
        return 0.0
    return max(0.0, (after.busy - before.busy) - (after.own - before.own)) / ticks_per_s / seconds


def cores_free(cores: int, others: float) -> int:
    """Threads to use on `cores` cores while others keep `others` cores' worth busy: at least one."""
    return max(1, min(cores, math.floor(cores - others + SLACK)))


class ThreadCap:
    """The cap to set from a run of measurements: it moves to a new value when two samples in a row
    ask for it. `cap` is 0 while every core is free (no cap), else the thread count."""

    def __init__(self, cores: int):
        self.cores = cores
        self.cap = 0
        self._pending: int | None = None

    def update(self, others: float) -> bool:
        """Feed one measurement; True when the cap changed."""
        free = cores_free(self.cores, others)
        want = 0 if free >= self.cores else free
        if want == self.cap:
            self._pending = None
            return False
        if self._pending != want:
            self._pending = want
            return False
        self.cap, self._pending = want, None
        return True


class ContentionMonitor(threading.Thread):
    """Daemon thread: every `interval` s, others' busy share of our cores → set_cap(cap)."""

    def __init__(
        self,
        set_cap: Callable[[int], None],
        interval: float = INTERVAL_S,
        proc: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(name="hkserve-kernel-threads", daemon=True)
        self.cores = frozenset(os.sched_getaffinity(0))
        self.set_cap, self.interval, self.proc, self.clock = set_cap, interval, proc, clock
        self.ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        self.decision = ThreadCap(len(self.cores))
        self.stopped = threading.Event()

    def poll(self, before: CpuSample) -> CpuSample:
        """One measurement since `before`; sets the cap when the decision changes it."""
        after = read_sample(self.cores, self.proc, self.clock)
        others = others_busy(before, after, self.ticks_per_s)
        if self.decision.update(others):
            cap = self.decision.cap
            self.set_cap(cap)
            log.info(
                "kernels: other processes keep %.1f of %d cores busy: %s",
                others,
                len(self.cores),
                f"kernel threads capped at {cap}" if cap else "kernel threads uncapped",
            )
        return after

    def run(self) -> None:
        sample = read_sample(self.cores, self.proc, self.clock)
        while not self.stopped.wait(self.interval):
            sample = self.poll(sample)


_monitor: ContentionMonitor | None = None
_lock = threading.Lock()


def watch(set_cap: Callable[[int], None]) -> bool:
    """Start the process's one monitor (a second call does nothing); False where /proc cannot tell
    (not Linux) or one core is all there is, and the pool stays uncapped."""
    global _monitor
    with _lock:
        if _monitor is not None:
            return True
        if sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2 or not Path("/proc/stat").exists():
            return False
        _monitor = ContentionMonitor(set_cap)
        _monitor.start()
        return True
