"""LLM.loglikelihood and LLM.score_labels against HF transformers forward passes (log_softmax of the
logits), on SmolLM2 in fp32: mixed batches of shared and unshared contexts, labels of several
tokens and labels that share their first token; shared contexts are prefilled once."""

import math
import random

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from transformers import AutoModelForCausalLM

from contbatch import LLM
from contbatch.scoring import admission_waves, tokenize_pair

TOL = 1e-4


@pytest.fixture(scope="module")
def llm(smollm_dir):
    return LLM(smollm_dir, dtype="float32", max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf(smollm_dir):
    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


def _hf_score(hf, context: list[int], continuation: list[int]) -> tuple[list[float], bool]:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    rows = logprobs[len(context) - 1 : -1]
    target = torch.tensor(continuation)
    values = rows.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
    return values, bool((rows.argmax(dim=-1) == target).all())


def test_pairs_match_hf_and_shared_contexts_are_prefilled_once(llm, hf):
    tokenizer = llm.get_tokenizer()
    long_context = "The history of the printing press begins in the fifteenth century, when " * 4
    short = ["The capital of France is", "2 + 2 =", "Water boils at"]
    requests = [(long_context, c) for c in (" Gutenberg", " a goldsmith from Mainz", " movable type.", " Gutenberg's press")]
    requests += [(c, t) for c in short for t in (" Paris", " 4", " 100 degrees Celsius", " London")]
    random.Random(3).shuffle(requests)
    outputs = llm.loglikelihood(requests)

    for (context, continuation), out in zip(requests, outputs):
        context_ids, continuation_ids = tokenize_pair(tokenizer, context, continuation)
        expected, greedy = _hf_score(hf, context_ids, continuation_ids)
        assert out.error is None and out.continuation_token_ids == continuation_ids
        assert len(out.token_logprobs) == len(expected)
        for ours, theirs in zip(out.token_logprobs, expected):
            assert abs(ours - theirs) <= TOL
        assert abs(out.logprob - sum(expected)) <= TOL * len(expected)
        assert out.is_greedy == greedy
    long_blocks = len(tokenizer(long_context.rstrip()).input_ids) // 16
    cached = sorted(o.num_cached_tokens for (c, _), o in zip(requests, outputs) if c == long_context)
    assert cached[0] == 0 and cached[1:] == [long_blocks * 16] * 3, "later pairs reuse the context's full blocks"
    assert any(o.is_greedy for o in outputs) and not all(o.is_greedy for o in outputs)


def test_token_id_pairs(llm, hf):
    rng = random.Random(9)
    context = [rng.randrange(100, 40000) for _ in range(40)]
    pairs = [(context, [rng.randrange(100, 40000) for _ in range(n)]) for n in (1, 3, 17)]
    for (ctx, cont), out in zip(pairs, llm.loglikelihood(pairs)):
        expected, greedy = _hf_score(hf, ctx, cont)
        assert max(abs(a - b) for a, b in zip(out.token_logprobs, expected)) <= TOL and out.is_greedy == greedy


def test_identical_pairs_are_scored_once_and_each_gets_its_own_result(llm, hf, monkeypatch):
    rng = random.Random(11)
    context = [rng.randrange(100, 40000) for _ in range(30)]
    a, b = [rng.randrange(100, 40000) for _ in range(3)], [rng.randrange(100, 40000) for _ in range(2)]
    pairs = [(context, a), (context, b), (context, a), (list(context), list(a))]
    started = []
    add_request = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda *args, **kw: started.append(args) or add_request(*args, **kw))
    outputs = llm.loglikelihood(pairs)
    assert len(started) == 2  # two distinct pairs ran, not four
    for (ctx, cont), out in zip(pairs, outputs):
        expected, greedy = _hf_score(hf, ctx, cont)
        assert max(abs(x - y) for x, y in zip(out.token_logprobs, expected)) <= TOL and out.is_greedy == greedy
    assert outputs[2] is not outputs[0] and outputs[2].token_logprobs is not outputs[0].token_logprobs
    assert outputs[2].token_logprobs == outputs[0].token_logprobs == outputs[3].token_logprobs
    assert outputs[2].num_cached_tokens == outputs[3].num_cached_tokens == len(context)


def test_labels_probabilities_match_hf(llm, hf):
    tokenizer = llm.get_tokenizer()
    labels = [" positive", " negative", " neutral", " very good", " very negative indeed"]  # shared first tokens, long ones
    assert len({tuple(tokenizer(label).input_ids[:1]) for label in labels}) < len(labels)
    prompts = ["Review: I loved every minute of it. Sentiment:", "Review: a dull, tiring film. Sentiment:"]
    scored = llm.score_labels(prompts, labels)
    for prompt, result in zip(prompts, scored):
        sums = {}
        for label in labels:
            context_ids, label_ids = tokenize_pair(tokenizer, prompt, label)
            sums[label] = sum(_hf_score(hf, context_ids, label_ids)[0])
        norm = math.log(sum(math.exp(v) for v in sums.values()))
        for label in labels:
            assert abs(result.logprobs[label] - sums[label]) <= 1e-3
            assert abs(result.probs[label] - math.exp(sums[label] - norm)) <= 1e-4
        assert result.label == max(sums, key=sums.get)
        assert abs(sum(result.probs.values()) - 1) < 1e-9
    assert scored[0].label != scored[1].label


def test_bad_pairs_are_listed_before_any_work(llm):
    steps = llm.engine.stats.num_steps
    with pytest.raises(ValueError) as info:
        llm.loglikelihood([("fine", " yes"), ("", " x"), ("a", ""), ("a", [1, 2]), ("x" * 5000, " y")])
    message = str(info.value)
    assert "4 invalid pair(s)" in message
    for index in (1, 2, 3, 4):
        assert f"requests[{index}]" in message
    assert "requests[0]" not in message
    assert llm.engine.stats.num_steps == steps
    with pytest.raises(ValueError, match="distinct"):
        llm.score_labels(["p"], [" a", " a"])
    with pytest.raises(ValueError) as info:
        llm.score_labels(["hi", "word " * 600], [" yes", " no"])
    assert "prompts[1] with label ' yes'" in str(info.value) and "prompts[1] with label ' no'" in str(info.value)
    assert "prompts[0]" not in str(info.value) and "requests[" not in str(info.value)
    assert llm.engine.stats.num_steps == steps


def test_admission_waves_put_each_contexts_first_pair_first():
    contexts = [(1,), (2,), (1,), (3,), (2,), (1,)]
    waves = list(admission_waves(contexts, [1] * 6, budget=2))
    assert waves == [[0, 1], [2, 5, 4], [3]]
    assert sorted(i for wave in waves for i in wave) == list(range(6))


def test_text_pairs_split_as_lm_eval_splits_them(llm):
    tokenizer = llm.get_tokenizer()
    context, continuation = tokenize_pair(tokenizer, "The capital of France is ", "Paris")
    assert context == tokenizer("The capital of France is").input_ids, "the trailing space moves to the continuation"
    assert tokenizer.decode(continuation) == " Paris"
    assert context + continuation == tokenizer("The capital of France is Paris").input_ids


def test_a_continuation_that_merges_with_the_context_is_scored_from_the_last_shared_token(llm, hf):
    """"hello wor" + "ld" tokenizes as "hello" + " world": the boundary token is scored whole
    after "hello", not skipped (lm-eval's split leaves no continuation token: log-probability 0)."""
    tokenizer = llm.get_tokenizer()
    context, continuation = tokenize_pair(tokenizer, "hello wor", "ld")
    assert tokenizer("hello wor").input_ids[: len(context)] == context and len(context) < len(tokenizer("hello wor").input_ids)
    assert context + continuation == tokenizer("hello world").input_ids and tokenizer.decode(continuation) == " world"
    (out,) = llm.loglikelihood([("hello wor", "ld")])
    expected, greedy = _hf_score(hf, context, continuation)
    assert out.continuation_token_ids == continuation and out.logprob < 0
    assert abs(out.logprob - sum(expected)) <= TOL and out.is_greedy == greedy
    with pytest.raises(ValueError, match=r"requests\[1\].*merges with every token of the context"):
        llm.loglikelihood([("fine", " yes"), ("Hel", "lo")])


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(["The capital of France is Paris.", "hello world, said the printer", "x = f(a, b)  # done"]),
       data=st.data())
def test_text_pairs_cover_the_whole_text(llm, text, data):
    """Wherever a text is split, the pair's ids are the whole text's ids: the context a prefix of
    the context's own ids, the continuation at least one token (or a clear refusal)."""
    cut = data.draw(st.integers(1, len(text) - 1))
    tokenizer = llm.get_tokenizer()
    try:
        context, continuation = tokenize_pair(tokenizer, text[:cut], text[cut:])
    except ValueError as exc:
        assert "merges with every token of the context" in str(exc) or "is empty" in str(exc)
        return
    assert context + continuation == tokenizer(text).input_ids and context and continuation
    assert tokenizer(text[:cut].rstrip()).input_ids[: len(context)] == context
