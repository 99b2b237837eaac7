"""The thread controller: threads follow the cores other processes leave free, read from real /proc."""

import os
import subprocess
import sys
import time

import pytest

from contbatch.engine.threads import CpuTimes, ThreadController, read_cpu_times, threads_for


def test_threads_for_leaves_the_cores_others_use():
    assert threads_for(0.0, 2, 2) == 2
    assert threads_for(0.2, 2, 2) == 2, "a little background load keeps every thread"
    assert threads_for(0.6, 2, 2) == 1
    assert threads_for(1.0, 2, 2) == 1
    assert threads_for(3.0, 2, 2) == 1, "never below one thread"
    assert threads_for(1.0, 8, 4) == 4, "never above the threads the engine started with"
    assert threads_for(2.5, 8, 8) == 5


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_controller_steps_down_under_load_and_back_up_when_it_ends():
    clock, sets = _FakeClock(), []
    times = [CpuTimes(busy=0, total=0, own=0)]
    controller = ThreadController(2, interval_s=0.5, read=lambda cpus: times[-1], set_threads=sets.append,
                                  clock=clock, cpus=frozenset({0, 1}))

    def interval(busy: int, own: int) -> None:  # ticks over 0.5 s: 50 a CPU, 100 in all
        last = times[-1]
        times.append(CpuTimes(last.busy + busy, last.total + 100, last.own + own))
        clock.now += 0.5
        controller.on_step()

    interval(busy=100, own=100)  # only us: both cores ours
    assert sets == [] and controller.threads == 2
    interval(busy=100, own=60)  # another process took 0.8 of a core
    assert sets == [1]
    interval(busy=100, own=50)  # it keeps its core while we run on one
    assert sets == [1]
    clock.now += 0.1
    controller.on_step()  # within the interval: nothing read, nothing changed
    interval(busy=52, own=50)  # it stopped
    assert sets == [1, 2]
    controller.reset()
    assert sets == [1, 2], "reset sets nothing when all threads are in use"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")
def test_real_counters_see_another_process_on_our_cores():
    cpus = frozenset(os.sched_getaffinity(0))
    before = read_cpu_times(cpus)
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    time.sleep(1.0)
    after = read_cpu_times(cpus)
    spinner.wait()
    wall = (after.total - before.total) / len(cpus)
    others = (after.busy - before.busy - (after.own - before.own)) / wall
    assert others > 0.5, f"a spinning process showed as {others:.2f} cores"
    assert after.own - before.own < 0.2 * wall, "sleeping did not count as our own time"
