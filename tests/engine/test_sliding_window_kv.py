"""Sliding-window KV memory: layers grouped by window into KV-cache groups, blocks that fall
out of a windowed group's window freed, prefix hits only where the window's blocks are cached.

The scheduler's random workloads run with windowed groups too (tests/engine/test_scheduler.py,
whose fake runner checks every position a query reads); here: how layers are grouped, the
block manager's invariants under random use of two groups, the prefix-hit rule, and the
memory claim measured on a long Gemma 3 generation through the engine.
"""

import math
import random

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from contbatch import LLM, SamplingParams
from contbatch.engine.block_manager import DEFAULT_LOOKAHEAD_TOKENS, NO_BLOCK, BlockManager
from contbatch.engine.kv_cache import KVCacheGroup, KVCacheSpec, kv_cache_groups
from contbatch.models.loader import read_config
from tests.conftest import TINY_VOCAB, HFOracle, assert_greedy_match
from tests.engine.test_scheduler import _check_block_invariants
from tests.test_generate_oracle import NEAR_TIE_TOL

SLIDING, FULL = 8, -1


def test_layers_are_grouped_by_window_into_groups_of_one_size():
    assert kv_cache_groups([FULL] * 4) == (KVCacheGroup(FULL, (0, 1, 2, 3)),)
    assert kv_cache_groups([SLIDING] * 3) == (KVCacheGroup(SLIDING, (0, 1, 2)),)
    # The tiny Gemma 3 of tests/conftest.py: 3 sliding layers, 2 global: groups of 2, one place left empty.
    assert kv_cache_groups([SLIDING, SLIDING, FULL, SLIDING, FULL]) == (
        KVCacheGroup(SLIDING, (0, 3)), KVCacheGroup(SLIDING, (1,)), KVCacheGroup(FULL, (2, 4)),
    )  # fmt: skip
    # gemma-3-1b: 26 layers, every 6th global: 4 global, 22 sliding in 6 groups of at most 4.
    groups = kv_cache_groups([FULL if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert [(g.window, len(g.layers)) for g in groups] == [(512, 4)] * 4 + [(512, 3)] * 2 + [(FULL, 4)]
    assert sorted(layer for g in groups for layer in g.layers) == list(range(26))
    # Nearly equal counts: the larger one sets the size (12 sliding + 13 global: two groups, not three).
    assert len(kv_cache_groups([SLIDING] * 12 + [FULL] * 13)) == 2


def test_each_layer_reads_its_own_place_of_the_shared_pool(phi3_gemma3_model_dirs):
    spec = KVCacheSpec.for_model(read_config(phi3_gemma3_model_dirs["gemma3"]), 16, torch.float32)
    assert spec.group_windows == (SLIDING, SLIDING, FULL) and spec.layers_per_block == 2
    cache, views = spec.allocate(num_blocks=3, device=torch.device("cpu"))
    assert cache.shape[:3] == (2, 2, 3)
    addresses = [(key.data_ptr(), value.data_ptr()) for key, value in views]
    for group in spec.groups:  # layers of one group: distinct places; one place serves several groups
        assert len({addresses[layer] for layer in group.layers}) == len(group.layers)
    assert len(set(addresses)) == spec.layers_per_block
    assert spec.blocks_for(17) == 3 * 2


@st.composite
def operations(draw):
    """Random calls a scheduler makes: admit (with the prefix cache), compute a chunk, fork,
    release blocks taken ahead, free (finish or preempt)."""
    stems = [[draw(st.integers(3, 9)) for _ in range(draw(st.integers(0, 24)))] for _ in range(2)]
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["admit", "compute", "compute", "compute", "fork", "release", "free"]))
        if kind == "admit":
            tail = draw(st.lists(st.integers(3, 9), min_size=1, max_size=20))
            ops.append((kind, draw(st.sampled_from(stems)) + tail))
        else:
            ops.append((kind, draw(st.integers(0, 1000)), draw(st.integers(1, 12))))
    return ops


@settings(max_examples=300, deadline=None)
@given(
    ops=operations(),
    windows=st.sampled_from([(3, FULL), (FULL, 6), (5, 5, FULL), (9,)]),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(4, 60),
    lookahead_tokens=st.sampled_from([0, 5, 64]),
    reserve=st.sampled_from([0, 4, None]),
)
def test_two_groups_keep_the_pool_consistent(ops, windows, block_size, num_blocks, lookahead_tokens, reserve):
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True, lookahead_tokens=lookahead_tokens,
                           freed_block_reserve=reserve, group_windows=windows)
    seqs: dict[int, list] = {}  # seq_id -> [token_ids, num_computed_tokens]
    next_id = 0
    for op in ops:
        if op[0] == "admit":
            tokens = list(op[1])
            cached = manager.find_cached_prefix(next_id, tokens)
            computed = len(cached) * block_size
            if manager.allocate(next_id, computed, len(tokens) - computed, cached, len(tokens) + 8):
                seqs[next_id] = [tokens, computed]
                _check_hit(manager, next_id, cached, computed)
            else:
                manager.free(next_id)
            next_id += 1
            continue
        if not seqs:
            continue
        seq_id = sorted(seqs)[op[1] % len(seqs)]
        tokens, computed = seqs[seq_id]
        if op[0] == "compute":
            if computed == len(tokens):
                tokens.append(3 + op[2] % 7)
            new = min(op[2], len(tokens) - computed)
            if manager.allocate(seq_id, computed, new, (), len(tokens) + 8):
                manager.block_table_update(seq_id, computed + new)
                seqs[seq_id][1] = computed + new
                manager.cache_computed_blocks(seq_id, tokens, computed + new)
                _check_window(manager, seq_id, computed)
        elif op[0] == "fork":
            manager.fork(seq_id, next_id, computed)
            seqs[next_id] = [list(tokens), computed]
            next_id += 1
        elif op[0] == "release":
            manager.release_lookahead([(s, len(t)) for s, (t, _) in seqs.items()])
        else:
            manager.free(seq_id)
            del seqs[seq_id]
        manager.take_pending_copies()
        _check_block_invariants(manager, seqs)
    for seq_id in list(seqs):
        manager.free(seq_id)
    assert manager.num_free_blocks == num_blocks and set(manager.ref_counts) <= {0}, "freeing all returns all blocks"


def _check_window(manager: BlockManager, seq_id: int, computed: int) -> None:
    """A windowed group holds nothing wholly before the window of the chunk just computed."""
    table = manager.seqs[seq_id].groups
    for group, window in enumerate(manager.group_windows):
        first = 0 if window <= 0 else max(0, computed - window + 1) // manager.block_size
        ids = table[group].block_ids
        assert all(b == NO_BLOCK for b in ids[:first]) and NO_BLOCK not in ids[first:]


def _check_hit(manager: BlockManager, seq_id: int, cached: list[tuple[int, ...]], computed: int) -> None:
    """Every block a hit leaves out of a windowed group is before the window of its first query."""
    for index, row in enumerate(cached):
        for group, block in enumerate(row):
            window = manager.group_windows[group]
            needed = window <= 0 or index >= max(0, computed - window + 1) // manager.block_size
            assert (block != NO_BLOCK) == needed


def test_windowed_blocks_stay_bounded_while_the_full_group_grows():
    window, block_size = 10, 4
    manager = BlockManager(200, block_size, enable_prefix_caching=True, lookahead_tokens=0,
                           group_windows=(window, FULL))
    tokens = [5, 6, 7]
    assert manager.allocate(0, 0, 3)
    for computed in range(3, 300):
        tokens.append(3 + computed % 5)
        assert manager.allocate(0, computed, 1)
        manager.cache_computed_blocks(0, tokens, computed + 1)
        assert len(manager.block_ids(0, 0)) <= math.ceil((window - 1) / block_size) + 1
        assert len(manager.block_ids(0, 1)) == manager.blocks_needed(computed + 1)
    assert manager.num_used_blocks == len(manager.block_ids(0, 0)) + manager.blocks_needed(300)


def test_a_prefix_hit_needs_the_blocks_of_the_window_before_it():
    """Window 4 in 4-token blocks: a hit of n blocks needs block n - 1 of the windowed group."""
    manager = BlockManager(64, 4, enable_prefix_caching=True, lookahead_tokens=0, freed_block_reserve=0,
                           group_windows=(4, FULL))
    prompt = list(range(3, 36))  # 33 tokens: 8 full blocks and one token
    assert manager.allocate(0, 0, 33)
    manager.cache_computed_blocks(0, prompt, 33)
    windowed = manager.block_ids(0, 0)
    assert manager.allocate(0, 33, 1), "a decode step frees the windowed blocks 0..6"
    assert manager.block_ids(0, 0) == windowed[7:]
    # The same prompt: every full block, and of the windowed ones only the last.
    full = manager.block_ids(0, 1)
    assert manager.find_cached_prefix(1, prompt) == [(NO_BLOCK, b) for b in full[:7]] + [(windowed[7], full[7])]
    # Another request takes the least recently freed blocks: windowed blocks 0..5 lose their prefix.
    assert manager.allocate(2, 0, 12)
    assert sorted(manager.block_ids(2, 0) + manager.block_ids(2, 1)) == sorted(windowed[:6])
    # Seven blocks still hit through windowed block 6; five do not, block 4 being gone (nor fewer).
    tail = [40, 41, 42]
    assert manager.find_cached_prefix(3, prompt[:28] + tail) == [(NO_BLOCK, b) for b in full[:6]] + [
        (windowed[6], full[6])
    ]
    assert manager.find_cached_prefix(4, prompt[:20] + tail) == []


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(length)] for length in (5, 21, 40)]


@pytest.mark.parametrize("lookahead", [0, DEFAULT_LOOKAHEAD_TOKENS])
@pytest.mark.parametrize("block_size", [4, 16])
def test_long_gemma3_generation_holds_window_blocks_only(block_size, lookahead, phi3_gemma3_model_dirs, long_prompts):
    """300 tokens each from Gemma 3 with window 8: per request, the sliding groups hold the
    blocks of the window (and, with lookahead, of one more window ahead), the global group
    every token's; the tokens are HF's."""
    model_dir = phi3_gemma3_model_dirs["gemma3"]
    max_tokens = 300
    llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=400, block_size=block_size,
              enable_prefix_caching=True)
    manager = llm.engine.block_manager
    manager.lookahead_tokens = lookahead
    assert manager.group_windows == (SLIDING, SLIDING, FULL)
    most = [0] * manager.num_groups  # the most blocks a request held in each group after its prompt

    def watch(stats) -> None:
        for request in llm.engine.scheduler.running:
            if request.num_output_tokens >= 2:  # the step decoded (the prompt's step holds its blocks)
                for group in range(manager.num_groups):
                    most[group] = max(most[group], len(manager.block_ids(request.seq_id, group)))

    llm.engine.add_stats_listener(watch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(long_prompts, params, use_tqdm=False)

    ahead = min(lookahead, SLIDING)
    assert most[0] == most[1] <= math.ceil((SLIDING + ahead - 1) / block_size) + 1
    assert most[2] >= math.ceil((len(long_prompts[-1]) + max_tokens - 2) / block_size)  # seen before the last step
    assert manager.num_free_blocks == manager.num_blocks
    oracle = HFOracle(model_dir)
    for prompt, output in zip(long_prompts, outputs):
        assert_greedy_match(oracle, prompt, output.outputs[0].token_ids, oracle.greedy(prompt, max_tokens, None),
                            NEAR_TIE_TOL)
