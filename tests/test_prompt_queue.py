"""PromptQueue: prompts put while a generation runs join the running requests at once, the
engine waits for prompts only when it has nothing to do, and outputs match generate()'s."""

import threading

import pytest

from contbatch import LLM, GenerationInterrupted, PromptQueue, SamplingParams

TIMEOUT_S = 60
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", skip_tokenizer_init=True, max_model_len=64)


class Consumer:
    """iter_generate(queue, GREEDY) in a thread, keeping every output by request_id."""

    def __init__(self, llm: LLM, queue: PromptQueue) -> None:
        self.outputs = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(llm, queue), daemon=True)
        self.thread.start()

    def _run(self, llm: LLM, queue: PromptQueue) -> None:
        try:
            for output in llm.iter_generate(queue, GREEDY):
                self.outputs[int(output.request_id)] = output
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def join(self) -> dict:
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive(), "iter_generate(queue) did not end after close()"
        if self.error is not None:
            raise self.error
        return self.outputs


def _tokens(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_prompt_put_while_requests_run_joins_them_without_waiting(llm):
    first, second = [5, 6, 7, 8], [9, 10, 11]
    long_run = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = {0: _tokens(llm, first, long_run), 1: _tokens(llm, second, GREEDY)}
    steps: list[int] = []  # running sequences in each step
    third_step = threading.Event()

    def on_step(stats) -> None:
        steps.append(stats.num_running)
        if len(steps) == 3:
            third_step.set()

    queue = PromptQueue()
    llm.engine.add_stats_listener(on_step)
    try:
        consumer = Consumer(llm, queue)
        assert queue.put({"prompt_token_ids": first, "sampling_params": long_run}) == 0
        assert third_step.wait(TIMEOUT_S), "the engine made no step while the queue was empty and a request ran"
        assert queue.put({"prompt_token_ids": second, "sampling_params": GREEDY}) == 1
        queue.close()
        outputs = consumer.join()
    finally:
        llm.engine.remove_stats_listener(on_step)
    assert {i: o.outputs[0].token_ids for i, o in outputs.items()} == expected
    assert outputs[1].metrics.first_scheduled_time < outputs[0].metrics.finished_time, (
        "the second prompt waited for the running request to finish"
    )
    assert max(steps) == 2, f"the two requests never ran in one step: running per step {steps}"


def test_idle_engine_waits_for_the_next_prompt_and_close_ends_it(llm):
    queue = PromptQueue()
    consumer = Consumer(llm, queue)
    consumer.thread.join(0.2)
    assert consumer.thread.is_alive(), "iter_generate ended on an empty, open queue"
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    ids = [queue.put(prompt) for prompt in prompts]
    queue.close()
    outputs = consumer.join()
    reference = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert ids == [0, 1, 2]
    assert [outputs[i].outputs[0].token_ids for i in ids] == [r.outputs[0].token_ids for r in reference]
    with pytest.raises(RuntimeError, match="closed"):
        queue.put([3, 4])


def test_bad_prompt_fails_alone(llm):
    queue = PromptQueue()
    consumer = Consumer(llm, queue)
    good = queue.put([5, 6])
    bad = queue.put({"prompt_token_ids": list(range(3, 80))})  # longer than max_model_len=64
    queue.close()
    outputs = consumer.join()
    assert "max_model_len=64" in outputs[bad].error
    assert outputs[good].error is None
    assert outputs[good].outputs[0].token_ids == _tokens(llm, [5, 6], GREEDY)


def test_a_producer_that_fails_stops_the_waiting_consumer_with_its_error(llm):
    """close(error=...): a consumer waiting on the queue raises the producer's error instead
    of waiting forever, having yielded what finished; generate() keeps the finished outputs."""
    queue = PromptQueue()
    consumer = Consumer(llm, queue)
    queue.put([5, 6])

    def producer_dies() -> None:
        while not consumer.outputs:  # the first output is out; the consumer waits for more
            consumer.thread.join(0.01)
        queue.close(error=KeyError("row 17"))

    threading.Thread(target=producer_dies, daemon=True).start()
    with pytest.raises(KeyError, match="row 17"):
        consumer.join()
    assert list(consumer.outputs) == [0]
    assert consumer.outputs[0].outputs[0].token_ids == _tokens(llm, [5, 6], GREEDY)

    queue = PromptQueue()
    queue.put([5, 6])
    queue.close(error=ValueError("upstream failed"))
    with pytest.raises(GenerationInterrupted) as info:
        llm.generate(queue, GREEDY, use_tqdm=False)
    assert isinstance(info.value.__cause__, ValueError) and info.value.outputs == []
    with pytest.raises(TypeError, match="error must be an exception"):
        PromptQueue().close(error="failed")
