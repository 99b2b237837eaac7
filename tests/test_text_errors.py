"""Text a tokenizer or a chat template cannot take is refused before any work, naming the
prompt, conversation and message; max_tokens=None generates to EOS or the context's end."""

import pytest

from contbatch import LLM, SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def llm(smollm_dir):
    return LLM(smollm_dir, dtype="float32", max_model_len=128)


def test_lone_surrogate_names_the_prompt_and_character(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt has a lone surrogate '\\udc80' at character 3"):
        llm.generate(["fine", "abc\udc80def"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_lone_surrogate_in_a_lazy_stream_ends_that_prompt_only(llm):
    outputs = list(llm.iter_generate(iter(["one", "x\ud800", "two"]), SamplingParams(max_tokens=2)))
    by_id = {int(o.request_id): o for o in outputs}
    assert "lone surrogate" in by_id[1].error
    assert by_id[0].error is None and by_id[2].error is None and len(by_id[2].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user"}], r"conversation 0, message 0 has no 'content'"),
        ([[{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"}, {"content": "x"}]],
         r"conversation 1, message 1 has no 'role'"),
        ([{"role": "user", "content": 5}], r"conversation 0, message 0: 'content' must be a str"),
        ([[{"role": "user", "content": "hi"}], "hello"], r"conversation 1 must be a non-empty list"),
    ],
)
def test_chat_names_the_bad_conversation_and_message(llm, messages, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)


def test_chat_template_failure_names_the_conversation(llm):
    with pytest.raises(ValueError, match=r"conversation 0: the chat template failed: .*no system"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False,
                 chat_template="{{ raise_exception('no system message') }}")


def test_max_tokens_none_runs_to_the_end_of_the_context(llm):
    prompt = list(range(10, 110))  # 100 tokens; max_model_len 128
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 28 and out.outputs[0].finish_reason == "length"


def test_max_tokens_none_stops_at_eos(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=None),
                   use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == EOS


@pytest.mark.parametrize(
    ("kwargs", "messages", "error", "match"),
    [
        (dict(continue_final_message=True), [{"role": "user", "content": "hi"}], ValueError,
         "continue_final_message=True continues the last message, so it needs add_generation_prompt=False"),
        (dict(chat_template_kwargs=["x"]), [{"role": "user", "content": "hi"}], TypeError,
         "chat_template_kwargs must be a dict or None, got list"),
        (dict(tools={"name": "x"}), [{"role": "user", "content": "hi"}], TypeError, "tools must be a list of dicts"),
        (dict(), [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ValueError,
         r"conversation 0, message 0, content part 0: only \{'type': 'text', 'text': str\} parts are served .*'image_url'"),
        (dict(), [{"role": "user", "content": ["hi"]}], ValueError, r"content part 0: .* got str"),
    ],
)
def test_chat_options_and_content_parts_are_checked_before_any_work(llm, kwargs, messages, error, match):
    steps = llm.engine.stats.num_steps
    with pytest.raises(error, match=match):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, **kwargs)
    assert llm.engine.stats.num_steps == steps
