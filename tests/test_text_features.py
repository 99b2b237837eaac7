"""Text-level features on the real SmolLM2 tokenizer and model (fp32): stop strings against
HF transformers' ``stop_strings``, and ``chat()`` against HF with the same chat template."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from contbatch import LLM, SamplingParams

EOS = 2  # <|im_end|>
QUESTIONS = [
    "Name three colours. Answer in one sentence.",
    "What is the capital of Italy? Explain briefly.",
    "Write two short sentences about cats.",
    "List the days of the week, separated by commas.",
]
STOPS = [".", ",", " and"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="module")
def hf_model(smollm_dir):
    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(smollm_dir):
    return LLM(smollm_dir, dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


def _chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.inference_mode()
def _hf_generate(model, tokenizer, prompt_ids: list[int], **kwargs) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                         eos_token_id=EOS, pad_token_id=0, tokenizer=tokenizer, **kwargs)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_match_hf_stop_strings(llm, hf_model, tokenizer, include):
    prompts = [_chat_ids(tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=STOPS, include_stop_str_in_output=include)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stopped = 0
    for prompt, output in zip(prompts, outputs):
        theirs = _hf_generate(hf_model, tokenizer, prompt, stop_strings=STOPS)
        completion = output.outputs[0]
        hf_text = tokenizer.decode(theirs, skip_special_tokens=True)
        hits = [(hf_text.find(s), s) for s in STOPS if s in hf_text]
        if not hits:  # HF ran to EOS or max_new_tokens without any stop string
            assert completion.token_ids == theirs
            assert completion.stop_reason is None
            continue
        stopped += 1
        start, stop = min(hits)
        # Both stop at the token that completes the first stop string: the same tokens...
        assert completion.token_ids == theirs, (completion.text, hf_text)
        assert completion.finish_reason == "stop" and completion.stop_reason == stop
        # ...and the text is cut at the stop string (kept when asked to).
        assert completion.text == hf_text[: start + (len(stop) if include else 0)]
    assert stopped >= len(QUESTIONS) - 1, "the prompts should mostly hit a stop string"


def test_stop_string_longer_than_one_token_is_matched_across_tokens(llm, tokenizer):
    prompt = _chat_ids(tokenizer, "Count from one to ten in words, separated by spaces.")
    free = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)[0].outputs[0]
    # A stop string that starts at token 2 and ends inside token 4: it spans three tokens.
    ends = [len(tokenizer.decode(free.token_ids[:i], skip_special_tokens=True)) for i in range(6)]
    assert len(free.token_ids) >= 6 and ends[5] > ends[4], free.text
    stop = free.text[ends[2] : ends[4] + 1]
    cut = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.stop_reason == stop
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_chat_equals_hf_greedy_on_the_chat_template(llm, hf_model, tokenizer):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]]
    conversations.append([
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Say hello."},
    ])
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert len(outputs) == len(conversations)
    for conversation, output in zip(conversations, outputs):
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == _hf_generate(hf_model, tokenizer, prompt_ids)
    single = llm.chat(conversations[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].text == outputs[0].outputs[0].text


def test_chat_content_parts_and_a_continued_final_message_match_hf(llm, hf_model, tokenizer):
    """OpenAI-style text parts are one string joined by newlines (vLLM's rule for text
    templates); continue_final_message leaves an assistant reply open, rendered as
    transformers renders it, and the model goes on from it as HF does."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]}]
    plain = [{"role": "user", "content": "Name a colour.\nOne word."}]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    from_parts, from_plain = (llm.chat(c, params, use_tqdm=False)[0] for c in (parts, plain))
    assert from_parts.prompt_token_ids == from_plain.prompt_token_ids == _chat_ids(tokenizer, "Name a colour.\nOne word.")
    assert from_parts.outputs[0].token_ids == from_plain.outputs[0].token_ids

    begun = [*plain, {"role": "assistant", "content": "My favourite colour is"}]
    out = llm.chat(begun, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    text = tokenizer.apply_chat_template(begun, tokenize=False, continue_final_message=True)
    assert text.endswith("My favourite colour is")
    assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert out.outputs[0].token_ids == _hf_generate(hf_model, tokenizer, out.prompt_token_ids)


def test_chat_template_kwargs_and_tools_reach_the_template(llm, tokenizer):
    template = ("{% for tool in tools or [] %}[tool {{ tool['name'] }}]{% endfor %}"
                "{% if formal %}Dear assistant: {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"name": "weather"}, {"name": "clock"}]
    conversation = [{"role": "user", "content": "hello"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    out = llm.chat(conversation, params, use_tqdm=False, chat_template=template, chat_template_kwargs={"formal": True},
                   tools=tools)[0]
    assert out.prompt == "[tool weather][tool clock]Dear assistant: hello"
    assert out.prompt_token_ids == tokenizer(out.prompt, add_special_tokens=False).input_ids
    assert llm.chat(conversation, params, use_tqdm=False, chat_template=template)[0].prompt == "hello"


def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm, tokenizer):
    """As vLLM's detokenizer does: the id ends token_ids, its text is not in text (unless
    include_stop_str_in_output), and the text before it is what the ids before it decode to."""
    prompt = _chat_ids(tokenizer, QUESTIONS[0])
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and tokenizer.decode([ids[i]]).strip())
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[ids[at]],
                                include_stop_str_in_output=include)
        cut = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert cut.token_ids == ids[: at + 1] and (cut.finish_reason, cut.stop_reason) == ("stop", ids[at])
        assert cut.text == tokenizer.decode(ids[: at + 1] if include else ids[:at], skip_special_tokens=True)


def test_detokenize_false_keeps_the_tokens_and_leaves_the_text_out(llm, tokenizer):
    prompts = [_chat_ids(tokenizer, q) for q in QUESTIONS[:2]]
    base = dict(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1, stop_token_ids=[13])
    with_text = llm.generate(prompts, SamplingParams(**base), use_tqdm=False)
    without = llm.generate(prompts, SamplingParams(**base, detokenize=False), use_tqdm=False)
    for a, b in zip(with_text, without):
        ours, theirs = a.outputs[0], b.outputs[0]
        assert theirs.token_ids == ours.token_ids and theirs.finish_reason == ours.finish_reason
        assert ours.text == tokenizer.decode(ours.token_ids, skip_special_tokens=True) != ""
        assert theirs.text == ""
        decoded = [lp.decoded_token for step in ours.logprobs for lp in step.values()]
        assert decoded and all(text is not None for text in decoded)
        assert all(lp.decoded_token is None for step in theirs.logprobs for lp in step.values())
        assert all(lp.decoded_token is None for step in b.prompt_logprobs[1:] for lp in step.values())
        assert [[lp.logprob for lp in step.values()] for step in theirs.logprobs] == \
            [[lp.logprob for lp in step.values()] for step in ours.logprobs]


def test_stop_strings_without_text_are_refused():
    with pytest.raises(ValueError, match="SamplingParams.stop strings are matched on the text.*detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)
    with pytest.raises(TypeError, match="SamplingParams.detokenize must be a bool"):
        SamplingParams(detokenize="no")
