"""The flash-attn path (contbatch/layers/flash_attention.py) against the reference, through
a stand-in for flash_attn.flash_attn_varlen_func that implements flash-attn's documented
contract on the CPU: paged K/V read as [num_blocks, page_size, kv_heads, head_size] through
the given strides, bottom-right causal alignment, window_size=(left, right), GQA.

No GPU or flash-attn exists here, so this checks our side of the contract (the cache view,
the cumulative lengths, the window, the block table), not flash-attn itself."""

import sys
import types

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from contbatch.layers import flash_attention
from contbatch.ops import reference


def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                                causal=False, window_size=(-1, -1), block_table=None, **unused):
    """flash-attn's documented semantics, written from its docstring, in dense PyTorch."""
    assert block_table is not None and k.dim() == 4 and k.stride(-1) == 1
    assert k.shape[1] % 256 == 0, "flash-attn pages must be a multiple of 256 tokens"
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k.shape[2]
    for s in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        seqlen_q, seqlen_k = q1 - q0, int(cu_seqlens_k[s + 1] - cu_seqlens_k[s])
        assert seqlen_q <= max_seqlen_q and seqlen_k <= max_seqlen_k
        pages = block_table[s, : -(-seqlen_k // k.shape[1])].long()
        keys = k[pages].reshape(-1, kv_heads, k.shape[-1])[:seqlen_k].float()  # [seqlen_k, kv_heads, d]
        values = v[pages].reshape(-1, kv_heads, v.shape[-1])[:seqlen_k].float()
        i = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q  # bottom-right aligned positions
        j = torch.arange(seqlen_k)[None, :]
        visible = j <= i if causal else torch.ones_like(i * j, dtype=torch.bool)
        if window_size[0] >= 0:
            visible &= j >= i - window_size[0]
        group = heads // kv_heads
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys.repeat_interleave(group, 1)) * softmax_scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(group, 1)).to(q.dtype)
    return out


@pytest.fixture
def fake_flash_attn(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = fake_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    flash_attention.flash_attn_varlen.cache_clear()
    yield
    flash_attention.flash_attn_varlen.cache_clear()


def test_without_flash_attn_the_path_is_off():
    flash_attention.flash_attn_varlen.cache_clear()
    if flash_attention.available():
        pytest.skip("flash-attn is installed here")
    assert not flash_attention.usable(torch.empty(1, 1, 64), torch.empty(1, 1, 256, 64))


def test_usable_only_on_cuda_with_256_token_pages(fake_flash_attn):
    assert flash_attention.available()
    assert not flash_attention.usable(torch.empty(1, 1, 64, dtype=torch.bfloat16), torch.empty(1, 1, 256, 64))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 600)), min_size=1, max_size=4),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    window=st.sampled_from([-1, 7, 300]),
    seed=st.integers(0, 2**31 - 1),
)
def test_flash_path_matches_reference(fake_flash_attn, lens, kv_heads, group, window, seed):
    g = torch.Generator().manual_seed(seed)
    head_size, page = 64, 256
    query_lens = [q for q, _ in lens]
    seq_lens = [q + cached for q, cached in lens]
    pages_per_seq = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages_per_seq) + 2
    key_cache = torch.randn(num_blocks, kv_heads, page, head_size, generator=g)
    value_cache = torch.randn(num_blocks, kv_heads, page, head_size, generator=g)
    shuffled = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(lens), max(pages_per_seq), dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages_per_seq):
        block_tables[s, :n] = shuffled[used : used + n]
        used += n
    query = torch.randn(sum(query_lens), kv_heads * group, head_size, generator=g)
    query_start_loc = torch.tensor([0, *torch.cumsum(torch.tensor(query_lens), 0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    expected = torch.empty_like(query)
    reference.paged_attention(expected, query, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc,
                              0.125, window)
    ours = flash_attention.paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc,
                                           max(query_lens), max(seq_lens), 0.125, window)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
