"""Sampling and output features checked against HF transformers where it has the same
feature, and against properties where it does not. fp32 throughout."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from contbatch import LLM, SamplingParams
from contbatch.engine.kv_cache import KVCacheSpec
from contbatch.models.loader import read_config
from tests.conftest import TINY_VOCAB, HFOracle, assert_greedy_match

LOGPROB_ATOL = 2e-4


def _prompts(count: int, seed: int = 7, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(2, max_len))] for _ in range(count)]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_step_logits(model, prompt: list[int], max_new_tokens: int, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy HF generation returning the tokens and the raw logits of every step."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


def _assert_logprobs_match(entry: dict, expected_logprobs: torch.Tensor, chosen: int, k: int) -> None:
    assert chosen in entry
    torch.testing.assert_close(entry[chosen].logprob, float(expected_logprobs[chosen]), atol=LOGPROB_ATOL, rtol=0)
    assert entry[chosen].rank == int((expected_logprobs > expected_logprobs[chosen]).sum()) + 1
    top_values, top_ids = expected_logprobs.topk(k)
    ranked = sorted((lp.rank, token) for token, lp in entry.items() if lp.rank <= k)
    assert [token for _, token in ranked] == top_ids.tolist()
    for token, value in zip(top_ids.tolist(), top_values.tolist()):
        torch.testing.assert_close(entry[token].logprob, value, atol=LOGPROB_ATOL, rtol=0)


def test_logprobs_match_hf_log_softmax(tiny_llm, hf_tiny):
    prompts = _prompts(6)
    outputs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        tokens, step_logits = _hf_step_logits(hf_tiny, prompt, 8)
        assert completion.token_ids == tokens
        assert len(completion.logprobs) == 8
        for entry, chosen, logits in zip(completion.logprobs, tokens, step_logits):
            _assert_logprobs_match(entry, torch.log_softmax(logits, -1), chosen, 5)
        expected_sum = sum(e[t].logprob for e, t in zip(completion.logprobs, tokens))
        assert completion.cumulative_logprob == pytest.approx(expected_sum)


@torch.inference_mode()
def test_prompt_logprobs_match_hf_forward(tiny_llm, hf_tiny):
    shared = _prompts(1, seed=3, max_len=60)[0] + [5] * 40  # long enough for several chunks and cached blocks
    prompts = [shared, shared + [9, 10]]
    tiny_llm.generate([shared], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # warm the prefix cache
    outputs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = torch.log_softmax(hf_tiny(torch.tensor([prompt])).logits[0].float(), -1)
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        assert output.num_cached_tokens == 0, "prompt logprobs need every position computed"
        for position in range(1, len(prompt)):
            _assert_logprobs_match(output.prompt_logprobs[position], expected[position - 1], prompt[position], 3)


def test_repetition_penalty_matches_hf(tiny_llm, tiny_dir):
    oracle = HFOracle(tiny_dir)
    prompts = _prompts(5, seed=11)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.7)
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        hf_tokens, _ = _hf_step_logits(oracle.model, prompt, 20, repetition_penalty=1.7)
        assert_greedy_match(oracle, prompt, output.outputs[0].token_ids, hf_tokens, 1e-3)


@torch.inference_mode()
def test_presence_and_frequency_penalties_follow_their_definition(tiny_llm, hf_tiny):
    """HF has no such processors: replay each step with HF logits and the OpenAI formula."""
    prompt = _prompts(1, seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.8)
    tokens = tiny_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    for step in range(len(tokens)):
        logits = hf_tiny(torch.tensor([prompt + tokens[:step]])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(tokens[:step], dtype=torch.long), minlength=TINY_VOCAB).float()
        penalised = logits - 0.8 * counts - 1.5 * (counts > 0).float()
        assert int(penalised.argmax()) == tokens[step]
    assert len(set(tokens)) > len(tokens) // 2, "penalties should spread the tokens out"


def test_min_tokens_matches_hf_min_new_tokens(tiny_dir, hf_tiny):
    llm = LLM(tiny_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=128)
    prompts = _prompts(8, seed=21)
    # Make EOS the model's favourite at some steps by choosing it as a stop id that greedy decoding produces.
    free_run = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    stop_id = free_run[0].outputs[0].token_ids[1]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop_id])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        hf_tokens = hf_tiny.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=12,
            min_new_tokens=6, do_sample=False, eos_token_id=[stop_id, 2], pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == hf_tokens
        assert stop_id not in output.outputs[0].token_ids[:6]
    assert any(o.outputs[0].stop_reason == stop_id for o in outputs)


def test_parallel_samples_share_the_prefilled_prompt(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256, enable_prefix_caching=False)
    prompt = _prompts(1, seed=2, max_len=3)[0] + list(range(10, 60))  # 52+ tokens: 3 full blocks + a partial one
    computed, copies, peak_used = [], [0], [0]

    def watch(stats):
        computed.extend(end - first for first, end in stats.query_spans if end <= len(prompt))
        copies[0] += stats.num_copied_blocks
        peak_used[0] = max(peak_used[0], stats.num_blocks_used)

    llm.engine.add_stats_listener(watch)
    params = SamplingParams(temperature=1.0, n=4, max_tokens=6, seed=123, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False)[0]

    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert sum(computed) == (len(prompt) - 1) + 4, "prompt prefilled once, then each sample computes its last token"
    assert copies[0] == 3, "three samples copy the shared partial block on their first write"
    blocks_per_sample = -(-(len(prompt) + 6) // 16)
    assert peak_used[0] < 4 * blocks_per_sample, "full prompt blocks are shared, not duplicated"
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1, "samples differ"

    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs], "seeded n samples reproduce"


def test_greedy_parallel_samples_equal_hf(tiny_llm, tiny_dir):
    oracle = HFOracle(tiny_dir)
    prompt = _prompts(1, seed=8)[0]
    output = tiny_llm.generate([prompt], SamplingParams(temperature=0, n=3, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    expected = oracle.greedy(prompt, 10, None)
    for completion in output.outputs:
        assert_greedy_match(oracle, prompt, completion.token_ids, expected, 1e-3)


def test_seeded_request_is_identical_alone_and_in_a_batch_of_100(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=128)
    probe = _prompts(1, seed=99)[0]
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_tokens=24, seed=2024, ignore_eos=True)
    alone = llm.generate([probe], params, use_tqdm=False)[0].outputs[0].token_ids

    others = _prompts(100, seed=100)
    crowd_params = [SamplingParams(temperature=1.0, max_tokens=random.Random(i).randrange(1, 30)) for i in range(100)]
    prompts = others[:50] + [probe] + others[50:]
    all_params = crowd_params[:50] + [params] + crowd_params[50:]
    in_batch = llm.generate(prompts, all_params, use_tqdm=False)[50].outputs[0].token_ids
    assert in_batch == alone


def test_seeded_requests_repeat_their_tokens_when_preempted(tiny_dir):
    """A preempted request is recomputed from its tokens so far; its random draws must go on
    from there, not start again. Eight seeded requests under a KV cache of nine blocks (the
    fewest a 144-token sequence needs) preempt one another; each must give the tokens it gives
    alone in a cache with room."""
    prompts = _prompts(8, seed=41, max_len=40)
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=60, seed=500 + i, ignore_eos=True)
              for i in range(8)]
    roomy = LLM(tiny_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=144)
    alone = [roomy.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    spec = KVCacheSpec.for_model(read_config(tiny_dir), 16, torch.float32)
    tight = LLM(tiny_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=144, max_num_seqs=8,
                kv_cache_memory=9 * spec.bytes_per_block * len(spec.groups))
    together = [output.outputs[0].token_ids for output in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.stats.num_preemptions > 0, "the small KV cache never forced a preemption"
    assert together == alone


def test_unseeded_sampling_respects_top_k(tiny_llm, hf_tiny):
    """With top_k=1 sampling at any temperature is greedy."""
    prompts = _prompts(4, seed=31)
    sampled = tiny_llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=6, ignore_eos=True), use_tqdm=False)
    greedy = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in greedy]


def test_iter_generate_streams_without_holding_finished_requests(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=16)
    prompts = (list(range(3, 3 + i % 20 + 1)) for i in range(400))
    seen = set()
    for output in llm.iter_generate(prompts, SamplingParams(temperature=0, max_tokens=1 + int(output_id_hash(len(seen))))):
        seen.add(int(output.request_id))
        assert not llm.engine.outputs.finished_samples, "finished samples must not accumulate"
        assert llm.engine.num_waiting <= 16, "the input is read lazily"
    assert seen == set(range(400))


def output_id_hash(value: int) -> int:
    return value % 3
