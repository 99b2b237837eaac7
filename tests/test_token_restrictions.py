"""vLLM's token restrictions: logit_bias, allowed_token_ids and bad_words against HF
transformers' processors for the same thing (sequence_bias, prefix_allowed_tokens_fn,
bad_words_ids), token by token in fp32; truncate_prompt_tokens against generating from the
truncated prompt; and the properties each promises under sampling."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from contbatch import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, HFOracle, assert_greedy_match

MAX_TOKENS = 16
NEAR_TIE = 1e-3


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=128)


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    return HFOracle(tiny_dir)


@torch.inference_mode()
def _hf_greedy(oracle: HFOracle, prompt: list[int], **processors) -> list[int]:
    ids = torch.tensor([prompt])
    out = oracle.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0, **processors)
    return out[0, len(prompt):].tolist()


def _greedy(**restrictions) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **restrictions)


def _favourites(llm: LLM, prompts: list[list[int]]) -> list[int]:
    """Tokens the unrestricted greedy runs produce: restricting them changes the outputs."""
    free = llm.generate(prompts, _greedy(), use_tqdm=False)
    return sorted({t for o in free for t in o.outputs[0].token_ids[:4]})


def test_logit_bias_matches_hf_sequence_bias_and_comes_before_the_repetition_penalty(tiny_llm, oracle):
    prompts = _prompts(6, seed=1)
    favourites = _favourites(tiny_llm, prompts)
    bias = {favourites[0]: -4.0, favourites[-1]: -2.5, 7: 3.0, 11: 1.5}
    outputs = tiny_llm.generate(prompts, _greedy(logit_bias=bias, repetition_penalty=1.3), use_tqdm=False)
    plain = tiny_llm.generate(prompts, _greedy(repetition_penalty=1.3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain], "the bias changed nothing"
    sequence_bias = {(token,): value for token, value in bias.items()}
    for prompt, output in zip(prompts, outputs):
        theirs = _hf_greedy(oracle, prompt, sequence_bias=sequence_bias, repetition_penalty=1.3)
        assert_greedy_match(oracle, prompt, output.outputs[0].token_ids, theirs, NEAR_TIE)


def test_allowed_token_ids_match_hf_prefix_allowed_tokens(tiny_llm, oracle):
    prompts = _prompts(6, seed=2)
    allowed = [5, 9, 17, 33, 64, 100]
    outputs = tiny_llm.generate(prompts, _greedy(allowed_token_ids=allowed), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        theirs = _hf_greedy(oracle, prompt, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
        assert output.outputs[0].token_ids == theirs


def test_restrictions_stay_with_their_request_in_a_mixed_batch(tiny_llm, oracle):
    """Rows with bias, allowed ids, bad words and none, sampled and greedy, in one batch:
    each greedy row equals HF with its own processor only."""
    prompts = _prompts(4, seed=3)
    favourites = _favourites(tiny_llm, prompts)
    per_row = [
        ({"logit_bias": {favourites[0]: -5.0}}, {"sequence_bias": {(favourites[0],): -5.0}}),
        ({"allowed_token_ids": [4, 8, 15, 16, 23, 42]}, {"prefix_allowed_tokens_fn": lambda b, i: [4, 8, 15, 16, 23, 42]}),
        ({}, {}),
        ({"logit_bias": {favourites[-1]: 2.0}, "allowed_token_ids": favourites}, None),
    ]
    params = [_greedy(**ours) for ours, _ in per_row[:3]]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=MAX_TOKENS, ignore_eos=True, **per_row[3][0]))
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, (_, theirs) in zip(prompts[:3], outputs, per_row):
        assert_greedy_match(oracle, prompt, output.outputs[0].token_ids, _hf_greedy(oracle, prompt, **theirs), NEAR_TIE)
    assert set(outputs[3].outputs[0].token_ids) <= set(favourites)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(allowed=st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=6), seed=st.integers(0, 2**32 - 1),
       temperature=st.floats(0.3, 2.0), top_p=st.floats(0.2, 1.0))
def test_sampled_tokens_are_always_allowed(tiny_llm, allowed, seed, temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=8, ignore_eos=True,
                            allowed_token_ids=allowed)
    outputs = tiny_llm.generate(_prompts(3, seed=seed % 1000), params, use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outputs)


def test_a_positive_bias_takes_over_sampling(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, logit_bias={"77": 60.0})
    output = tiny_llm.generate(_prompts(1, seed=4), params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == [77] * 12  # a JSON-style string key names token 77


def test_truncate_prompt_tokens_generates_from_the_last_tokens(tiny_llm):
    prompts = _prompts(4, seed=5)
    long_prompt = [random.Random(6).randrange(3, TINY_VOCAB) for _ in range(200)]  # past max_model_len=128
    outputs = tiny_llm.generate(prompts + [long_prompt], _greedy(truncate_prompt_tokens=3), use_tqdm=False)
    expected = tiny_llm.generate([p[-3:] for p in prompts + [long_prompt]], _greedy(), use_tqdm=False)
    for prompt, output, reference in zip(prompts + [long_prompt], outputs, expected):
        assert output.prompt_token_ids == prompt[-3:]
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
    whole = tiny_llm.generate([long_prompt], _greedy(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.error is None and whole.prompt_token_ids == long_prompt[-127:]
    with pytest.raises(ValueError, match="prompt has 200 tokens"):
        tiny_llm.generate([long_prompt], _greedy(), use_tqdm=False)


def test_a_prompt_with_its_own_params_is_truncated_by_them(tiny_llm):
    prompt = _prompts(1, seed=7)[0] + [5, 6, 7, 8]
    outputs = tiny_llm.generate(
        [prompt, {"prompt_token_ids": prompt, "sampling_params": _greedy(truncate_prompt_tokens=2)}],
        _greedy(truncate_prompt_tokens=4), use_tqdm=False,
    )
    assert [o.prompt_token_ids for o in outputs] == [[5, 6, 7, 8], [7, 8]]


def test_streamed_prompts_are_truncated_too(tiny_llm):
    prompts = _prompts(3, seed=8)
    outputs = list(tiny_llm.iter_generate(iter(prompts), _greedy(truncate_prompt_tokens=2)))
    assert sorted(o.prompt_token_ids for o in outputs) == sorted(p[-2:] for p in prompts)


@pytest.mark.parametrize(
    ("restriction", "message"),
    [
        ({"logit_bias": {TINY_VOCAB: 1.0}}, "logit_bias must be token ids in \\[0, "),
        ({"allowed_token_ids": [3, TINY_VOCAB + 5]}, "allowed_token_ids must be token ids in \\[0, "),
        ({"truncate_prompt_tokens": 128}, "truncate_prompt_tokens must be None, -1 or in \\[1, 127\\]"),
        ({"bad_words": ["cat"]}, "bad_words need a tokenizer"),
        ({"allowed_token_ids": [2], "min_tokens": 2, "max_tokens": 4}, "every allowed token ends the request"),
    ],
)
def test_what_this_model_cannot_serve_is_refused_before_any_work(tiny_llm, restriction, message):
    steps = []
    tiny_llm.engine.add_stats_listener(steps.append)
    try:
        with pytest.raises(ValueError, match=f"sampling_params\\[1\\]: .*{message}"):
            tiny_llm.generate(_prompts(2, seed=9), [SamplingParams(), SamplingParams(**restriction)], use_tqdm=False)
    finally:
        tiny_llm.engine.remove_stats_listener(steps.append)
    assert steps == []


# The real tokenizer: bad words are words.

@pytest.fixture(scope="module")
def smollm(smollm_dir):
    return LLM(smollm_dir, dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def smollm_oracle(smollm_dir):
    return HFOracle(smollm_dir)


def _word_sequences(tokenizer, word: str) -> list[list[int]]:
    """The word's tokens at the start of a text and after a space, as the tokenizer gives them."""
    return [tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]


def test_bad_words_match_hf_bad_words_ids(smollm, smollm_oracle, smollm_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    questions = ["What is the capital of France?", "Name three colours.", "Describe a cat in one sentence."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in questions]
    free = smollm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    words = [w.strip(".,!") for o in free for w in o.outputs[0].text.split()[2:5]]
    multi_token = [w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) > 1]
    assert multi_token, f"no word of several tokens among {words}: the test would not cover them"
    bad_words = sorted(set(words))
    outputs = smollm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, bad_words=bad_words), use_tqdm=False)
    bad_ids = [ids for w in bad_words for ids in _word_sequences(tokenizer, w)]
    for prompt, output, unrestricted in zip(prompts, outputs, free):
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        theirs = _hf_bad_words(smollm_oracle, ids, bad_ids)
        assert output.outputs[0].token_ids != unrestricted.outputs[0].token_ids
        assert_greedy_match(smollm_oracle, ids, output.outputs[0].token_ids, theirs, NEAR_TIE)


@torch.inference_mode()
def _hf_bad_words(oracle: HFOracle, prompt: list[int], bad_ids: list[list[int]]) -> list[int]:
    ids = torch.tensor([prompt])
    out = oracle.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                eos_token_id=2, pad_token_id=0, bad_words_ids=bad_ids)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(2) + 1] if 2 in tokens else tokens


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), words=st.lists(st.sampled_from(
    ["the", "cat", "and", "is", "a", "of", "blue", "to", "I", "you", "elephant", "however"]), min_size=1, max_size=5))
def test_sampled_outputs_never_contain_a_bad_word(smollm, seed, words):
    tokenizer = smollm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=24, bad_words=words, ignore_eos=True)
    outputs = smollm.generate(["Tell me about the animals and the colours of the world.", "Write a story:"], params,
                              use_tqdm=False)
    sequences = [ids for w in words for ids in _word_sequences(tokenizer, w)]
    for completion in (c for output in outputs for c in output.outputs):  # forked samples included
        tokens = completion.token_ids
        for ids in sequences:
            windows = {tuple(tokens[i : i + len(ids)]) for i in range(len(tokens) - len(ids) + 1)}
            assert tuple(ids) not in windows, f"{tokenizer.decode(ids)!r} was generated: {completion.text!r}"


def test_bad_words_that_leave_no_allowed_token_are_refused(smollm):
    tokenizer = smollm.get_tokenizer()
    allowed = tokenizer.encode(" cat", add_special_tokens=False)
    with pytest.raises(ValueError, match="every allowed token is one of bad_words"):
        smollm.generate(["Hi"], SamplingParams(allowed_token_ids=allowed, bad_words=["cat"]), use_tqdm=False)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_its_restrictions_leave_no_token_ends_alone(smollm, temperature):
    """Allowed " cat" and " dog", with "cat cat" and "cat dog" bad words and " cat" biased to come
    first: after it no token is left. That request ends as "abort" with its text so far,
    instead of sampling a token every mask forbids; the request beside it runs on."""
    tokenizer = smollm.get_tokenizer()
    cat, dog = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" cat", " dog"))
    stuck = SamplingParams(temperature=temperature, seed=1, max_tokens=8, allowed_token_ids=[cat, dog],
                           bad_words=["cat cat", "cat dog"], logit_bias={cat: 50.0})
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = smollm.generate(["Name an animal:", "Name a colour:"], [stuck, free], use_tqdm=False)
    assert (outputs[0].outputs[0].token_ids, outputs[0].outputs[0].finish_reason) == ([cat], "abort")
    alone = smollm.generate(["Name a colour:"], free, use_tqdm=False)[0]
    assert outputs[1].outputs[0].token_ids == alone.outputs[0].token_ids and len(alone.outputs[0].token_ids) == 8


def test_samples_a_grammar_and_allowed_ids_leave_no_token_end_at_once(smollm):
    """A grammar of "yes"/"no" with only " cat" allowed: both forked samples end before their
    first token, with no token that the grammar or the allowed ids forbid."""
    cat = smollm.get_tokenizer().encode(" cat", add_special_tokens=False)
    params = SamplingParams(temperature=0.7, seed=2, n=2, max_tokens=8, allowed_token_ids=cat, logprobs=1,
                            structured_outputs={"choice": ["yes", "no"]})
    output = smollm.generate(["Is the sky blue?"], params, use_tqdm=False)[0]
    assert [(c.token_ids, c.finish_reason, c.logprobs) for c in output.outputs] == [([], "abort", [])] * 2
