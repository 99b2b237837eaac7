"""The thread controller: threads follow the cores other processes leave free, read from real /proc."""

import os
import subprocess
import sys
import time

import pytest

from contbatch import LLM, SamplingParams, ops
from contbatch.engine.threads import CpuTimes, ThreadController, read_cpu_times, threads_for
from tests.ops.paged_batch import cpu_isa, isa_params, num_threads
from tests.test_generate_oracle import _tiny_prompts


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


def _outputs(model_dir, isa: str, threads: int, **engine) -> list:
    prompts, max_tokens = _tiny_prompts()
    # A 300-token prompt last: decoding alone, its keys are split across partitions (split-K).
    prompts, max_tokens = [*prompts[:8], list(range(3, 303))], [*max_tokens[:8], 30]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=3) for n in max_tokens]
    with cpu_isa(isa), num_threads(threads):
        llm = LLM(model_dir, skip_tokenizer_init=True, device="cpu", max_num_seqs=6, max_num_batched_tokens=32,
                  max_model_len=400, adapt_threads=False, **engine)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.skipif(ops.BACKEND != "native", reason="the C++ extension is not built")
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("engine", [dict(dtype="bfloat16"), dict(dtype="float32"),
                                    dict(dtype="bfloat16", quantization="int8")], ids=["bf16", "fp32", "int8"])
def test_outputs_do_not_depend_on_the_thread_count(tiny_model_dirs, isa, engine):
    """The controller changes the thread count with the machine's load, so tokens and logprobs
    must be the same at any count. Before, split-K attention (every tier) and the bf16 linears
    of the tiers that widen bf16 summed in another order at 1 thread than at 2 or 3, and 6 of
    these 12 cases failed."""
    model_dir = tiny_model_dirs["llama3-rope-tied"]
    one = _outputs(model_dir, isa, 1, **engine)
    for threads in (2, 3):
        assert _outputs(model_dir, isa, threads, **engine) == one, f"{threads} threads differ from 1"
