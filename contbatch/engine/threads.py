"""Intra-op threads that follow the cores other processes leave free (CPU only).

OpenMP's worker threads spin while they wait for each other at the end of every parallel
region. When another process takes one of the cores, the thread that shares it is
descheduled for whole time slices while its partners spin, and a decode step takes 2-4x
longer than with one thread (docs/performance.md, "A busy core"). Waiting passively
instead costs 40% on an idle machine, so the engine keeps spinning threads and uses only
the cores that are free: every ``interval_s`` it reads how busy its CPUs were
(/proc/stat, only the CPUs the process may run on) less its own CPU time
(/proc/self/stat), and sets torch's thread count to the cores left. Its own spinning
counts as its own, so a core it gives up shows as taken by the other process while that
one runs, and comes back as soon as it stops.
"""

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_INTERVAL_S = 0.25
OTHERS_SLACK = 0.25
"""Cores of other processes' load that is ignored (daemons, the shell): less than this keeps every thread."""


@dataclass(frozen=True)
class CpuTimes:
    busy: int  # clock ticks our CPUs were busy, whoever ran (steal included: a hypervisor's other tenants)
    total: int  # clock ticks our CPUs existed, summed over them
    own: int  # clock ticks this process ran (user + system, all its threads)


def read_cpu_times(cpus: frozenset[int]) -> CpuTimes | None:
    """This moment's counters, or None where /proc cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and line[3].isdigit()]
        with open("/proc/self/stat") as own_stat:
            own_fields = own_stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    busy = total = 0
    for fields in lines:
        if int(fields[0][3:]) not in cpus:
            continue
        ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    own = int(own_fields[11]) + int(own_fields[12])  # utime, stime (fields 14 and 15 of the line)
    return CpuTimes(busy, total, own) if total else None


def threads_for(others_cores: float, num_cores: int, max_threads: int) -> int:
    """Threads to use when other processes keep ``others_cores`` cores busy."""
    taken = max(0, math.ceil(others_cores - OTHERS_SLACK))
    return max(1, min(max_threads, num_cores - taken))


class ThreadController:
    """Called once a step; changes torch's intra-op thread count at most once per interval."""

    def __init__(
        self,
        max_threads: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        read: Callable[[frozenset[int]], CpuTimes | None] = read_cpu_times,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval_s = interval_s
        self._read = read
        self._set_threads = set_threads
        self._clock = clock
        self._cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self._last_time = clock()
        self._last = read(self._cpus)

    def on_step(self) -> None:
        now = self._clock()
        if now - self._last_time < self.interval_s:
            return
        current = self._read(self._cpus)
        previous, self._last, self._last_time = self._last, current, now
        if current is None or previous is None or current.total <= previous.total:
            return
        wall_ticks = (current.total - previous.total) / len(self._cpus)
        others = (current.busy - previous.busy - (current.own - previous.own)) / wall_ticks
        self._use(threads_for(others, len(self._cpus), self.max_threads))

    def reset(self) -> None:
        """Back to every thread (the engine is idle; the next run measures afresh)."""
        self._use(self.max_threads)
        self._last, self._last_time = self._read(self._cpus), self._clock()

    def _use(self, threads: int) -> None:
        if threads != self.threads:
            self.threads = threads
            self._set_threads(threads)
