"""The engine's stats interface: per-step StepStats agree with the outputs and with the totals."""

import random

from contbatch import LLM, SamplingParams
from tests.conftest import TINY_VOCAB


def test_step_stats_account_for_every_token_block_and_preemption(tiny_model_dirs):
    block_size = 16
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              max_num_seqs=6, max_num_batched_tokens=24)
    rng = random.Random(5)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(2 * block_size)]
    prompts = [shared + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, n=2)
    steps = []
    llm.engine.add_stats_listener(steps.append)
    before = llm.engine.stats.num_steps
    outputs = llm.generate(prompts, params, use_tqdm=False)

    assert len(steps) == llm.engine.stats.num_steps - before > 0
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert sum(s.num_sampled for s in steps) == generated == 12 * 2 * 9
    for stats in steps:
        assert 1 <= stats.num_running <= 6 and len(stats.query_spans) == stats.num_running
        assert stats.num_scheduled_tokens == sum(end - first for first, end in stats.query_spans) <= 24
        assert stats.num_sampled <= stats.num_running
        assert 0 < stats.num_blocks_used <= stats.num_blocks_total
        assert 0 <= stats.model_s <= stats.step_s
    assert sum(s.num_preemptions for s in steps) == 0, "the default cache holds the whole batch"
    hits = sum(s.num_prefix_hit_tokens for s in steps)
    assert hits == sum(o.num_cached_tokens for o in outputs) > 0, "later prompts reuse the shared two blocks"
    # A prompt is computed once up to its last token, which each of its 2 samples computes,
    # then each sample computes its outputs but the last: cached prefixes are not computed.
    computed = sum(end - first for s in steps for first, end in s.query_spans)
    assert computed == sum(len(p) for p in prompts) + 12 + 12 * 2 * 8 - hits
    assert sum(s.num_prefix_queried_tokens for s in steps) == sum(len(p) for p in prompts)
    assert llm.engine.stats.num_generated_tokens >= generated
