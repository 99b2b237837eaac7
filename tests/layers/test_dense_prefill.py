"""Long prefill chunks through sdpa (contbatch/layers/dense_prefill.py) against the reference
paged attention, in steps that mix them with short chunks and decodes."""

import contextlib

import pytest
import torch

from contbatch import ops
from contbatch.layers import dense_prefill
from contbatch.layers.attention import AttentionMetadata, PagedAttention
from contbatch.ops import reference
from tests.ops.paged_batch import TOLERANCES, isa_params, random_batch

LONG = dense_prefill.MIN_QUERY_ROWS
# (context length, query rows): long chunks after a cached prefix and from the start, one of
# exactly the threshold, a short chunk and decodes.
SEQUENCES = [(LONG + 180, LONG + 80), (LONG + 8, LONG + 8), (1000, LONG), (40, 20), (300, 1), (77, 1)]


@pytest.mark.parametrize("cache_dtype", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [-1, 64, 100_000])
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_long_chunks_match_the_reference_in_mixed_steps(dtype, sliding_window, cache_dtype, kv_heads):
    gen = torch.Generator().manual_seed(sliding_window % 1000 + kv_heads)
    seq_lens, query_lens = zip(*SEQUENCES)
    batch = random_batch(gen, list(seq_lens), list(query_lens), num_heads=8, num_kv_heads=kv_heads, head_size=64,
                         block_size=16, dtype=dtype, cache_dtype=torch.int8 if cache_dtype == "int8" else None)
    scale = 0.11
    expected = torch.empty_like(batch.query)
    reference.paged_attention(expected, *batch.attention_args(), scale, sliding_window)
    out = torch.full_like(batch.query, float("nan"))
    dense_prefill.attend(out, *batch.attention_args(), scale, sliding_window)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_chunks_without_pytorchs_log_sum_exp_kernel_take_the_masked_path(monkeypatch, dtype):
    """Older or other PyTorch builds may lack the private kernel that returns log-sum-exps."""
    monkeypatch.setattr(dense_prefill, "_flash_kernel_with_lse", lambda: None)
    gen = torch.Generator().manual_seed(7)
    batch = random_batch(gen, [LONG + 180, 40], [LONG + 80, 20], num_heads=8, num_kv_heads=2, head_size=64,
                         block_size=16, dtype=dtype)
    expected = torch.empty_like(batch.query)
    reference.paged_attention(expected, *batch.attention_args(), 0.11, -1)
    out = torch.full_like(batch.query, float("nan"))
    dense_prefill.attend(out, *batch.attention_args(), 0.11, -1)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("behaviour", ["raises", "other signature", "other output"])
def test_a_private_flash_kernel_that_does_not_behave_is_not_used(monkeypatch, behaviour):
    """PyTorch's private log-sum-exp kernel may change or vanish in other versions: then later
    chunks take the masked path rather than failing a run."""
    def kernel(query, key, value, dropout_p, is_causal, *, scale=None):
        if behaviour == "raises":
            raise RuntimeError("not implemented for this build")
        return query, torch.zeros(query.shape[-2])  # a log-sum-exp of the wrong shape
    def other_signature(query, key, value):
        return query, torch.zeros(query.shape[:-1])
    chosen = other_signature if behaviour == "other signature" else kernel
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", chosen, raising=False)
    assert dense_prefill._flash_kernel_with_lse.__wrapped__() is None  # tried afresh, not the cached answer


@pytest.mark.skipif(not torch.__version__.startswith("2.13."), reason="checked on the pinned torch 2.13 only")
def test_pytorchs_flash_kernel_with_log_sum_exps_is_found_on_the_pinned_torch():
    """torch 2.13 (the README's pin) has it: the mask-free path is what runs and is tested."""
    assert dense_prefill._flash_kernel_with_lse() is not None


@pytest.mark.parametrize("isa", isa_params() if ops.BACKEND == "native" else [None])
def test_paged_attention_layer_takes_the_dense_path_only_for_long_queries_on_sdpa_tiers(monkeypatch, isa):
    gen = torch.Generator().manual_seed(0)
    calls = []
    attend = dense_prefill.attend
    monkeypatch.setattr(dense_prefill, "attend", lambda *args: calls.append(1) or attend(*args))
    sdpa_tier = isa not in dense_prefill.PAGED_LONG_CHUNK_TIERS  # None: the reference ops, no tier
    layer = PagedAttention(num_heads=8, num_kv_heads=2, head_dim=64)
    for query_lens, dense in (([LONG, 1], sdpa_tier), ([LONG - 1, 1], False)):
        seq_lens = [q + 5 for q in query_lens]
        batch = random_batch(gen, seq_lens, query_lens, 8, 2, 64, 16, torch.float32)
        metadata = AttentionMetadata(
            slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.int64), block_tables=batch.block_tables,
            seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        )  # fmt: skip
        k = torch.zeros(sum(query_lens), 2, 64)
        calls.clear()
        with ops.use_cpu_isa(isa) if isa is not None else contextlib.nullcontext():
            out = layer(batch.query, k, k, (batch.key_cache, batch.value_cache), metadata)
        assert bool(calls) == dense
        expected = torch.empty_like(batch.query)
        reference.paged_attention(expected, *batch.attention_args(), layer.scale, -1)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
