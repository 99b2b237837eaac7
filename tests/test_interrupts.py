"""Ctrl-C (SIGINT) during LLM.generate(): the finished outputs come back on the exception,
the engine is left consistent, and the same LLM generates again.

Request i of PROMPTS asks for i + 1 tokens, so it finishes in step i + 1 (every prompt is
admitted in step 1): which outputs a Ctrl-C keeps says which steps completed.
"""

import os
import signal

import pytest

from contbatch import LLM, GenerationCancelled, SamplingParams

NUM_PROMPTS = 8
PROMPTS = [[5 + i, 9, 11 + i] for i in range(NUM_PROMPTS)]
PARAMS = [SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True) for i in range(NUM_PROMPTS)]


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler for each test, as an interactive run has it: a process
    started in the background by a non-interactive shell inherits SIGINT ignored, and there
    a Ctrl-C never reaches generate() (these tests then failed for that reason alone)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", skip_tokenizer_init=True, max_model_len=64)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _sigint_in_step(llm, monkeypatch, step: int, signals: int) -> None:
    """Send ``signals`` SIGINTs to this process from inside engine step ``step`` (1-based),
    before its model forward."""
    runner, calls = llm.engine.runner, [0]
    execute = runner.execute

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGINT)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", interrupted)


def _assert_runs_again(llm, reference) -> None:
    assert llm.engine.block_manager.num_used_blocks == 0, "blocks leaked by the interrupted run"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == reference


@pytest.mark.parametrize("step", [1, 3, 6])
def test_one_ctrl_c_ends_the_step_then_stops_with_its_outputs(llm, reference, monkeypatch, step):
    _sigint_in_step(llm, monkeypatch, step, signals=1)
    with pytest.raises(GenerationCancelled) as cancelled:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert isinstance(cancelled.value, KeyboardInterrupt), "code catching Exception would swallow it"
    outputs = cancelled.value.outputs
    assert [int(o.request_id) for o in outputs] == list(range(step)), "the interrupted step did not complete"
    assert [o.outputs[0].token_ids for o in outputs] == reference[:step]
    monkeypatch.undo()
    _assert_runs_again(llm, reference)


def test_a_second_ctrl_c_in_the_same_step_stops_at_once(llm, reference, monkeypatch):
    step = 4
    _sigint_in_step(llm, monkeypatch, step, signals=2)
    with pytest.raises(GenerationCancelled) as cancelled:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    outputs = cancelled.value.outputs
    assert [int(o.request_id) for o in outputs] == list(range(step - 1)), "the step was not cut short"
    assert [o.outputs[0].token_ids for o in outputs] == reference[: step - 1]
    monkeypatch.undo()
    _assert_runs_again(llm, reference)


def test_ctrl_c_while_reading_a_prompt_stream_keeps_the_finished(llm, reference):
    def prompts():
        yield from PROMPTS
        raise KeyboardInterrupt  # e.g. Ctrl-C while the generator waits on its input

    with pytest.raises(GenerationCancelled) as cancelled:
        llm.generate(prompts(), PARAMS, use_tqdm=False)
    for output in cancelled.value.outputs:
        assert output.outputs[0].token_ids == reference[int(output.request_id)]
    _assert_runs_again(llm, reference)


def test_a_program_with_its_own_sigint_handler_keeps_it(llm, reference, monkeypatch):
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        _sigint_in_step(llm, monkeypatch, 2, signals=1)
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert received == [signal.SIGINT]
    assert [o.outputs[0].token_ids for o in outputs] == reference
