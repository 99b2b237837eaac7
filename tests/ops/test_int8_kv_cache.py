"""The int8 KV cache (kv_cache_dtype="int8"): the quantized rows' round trip, read by
paged_attention and copied by copy_blocks, against contbatch.ops.reference on every ISA tier
(reshape_and_cache writing them: tests/ops/test_cache.py); the layout is in
docs/design/kv_cache_layout.md."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from contbatch.ops import reference
from tests.ops.paged_batch import (
    SUPPORTED_ISAS,
    TOLERANCES,
    isa_params,
    random_batch,
    require_native,
    run_both,
)

require_native()

SCALE_BYTES = reference.KV_INT8_SCALE_BYTES


def scales(rows: torch.Tensor) -> torch.Tensor:
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 20), head_size=st.sampled_from([16, 64, 80, 256]), magnitude=st.sampled_from([1e-6, 1.0, 3e4]),
       seed=st.integers(0, 2**31 - 1))
def test_round_trip_error_is_at_most_half_a_step_per_row(rows, head_size, magnitude, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, head_size, generator=gen) * magnitude
    x[0] = 0.0  # a zero row: scale 0, values 0
    quantized = reference.quantize_kv_rows(x)
    assert quantized.dtype == torch.int8 and quantized.shape == (rows, head_size + SCALE_BYTES)
    step = scales(quantized)
    torch.testing.assert_close(step, x.abs().amax(-1) / 127, rtol=1e-6, atol=0)
    error = (reference.dequantize_kv_rows(quantized) - x).abs()
    assert bool((error <= step[:, None] * (0.5 + 1e-5)).all()), float((error / step[:, None]).max())
    assert bool((quantized[0] == 0).all())
    assert bool((quantized[:, :head_size].abs() <= 127).all())


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    num_kv_heads = draw(st.integers(1, 6))
    seq_lens, query_lens = [], []
    for _ in range(draw(st.integers(1, 4))):
        seq_len = draw(st.integers(1, 5 * block_size + 3))
        kind = draw(st.sampled_from(["decode", "prefill", "chunked", "idle"]))
        q_len = {"decode": 1, "prefill": seq_len, "idle": 0}.get(kind) or draw(st.integers(1, seq_len))
        seq_lens.append(seq_len)
        query_lens.append(q_len)
    return dict(dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), block_size=block_size,
                head_size=draw(st.sampled_from([64, 80, 96, 128, 256])), num_kv_heads=num_kv_heads,
                num_heads=draw(st.sampled_from([1, 2, 3, 8])) * num_kv_heads, seq_lens=seq_lens,
                query_lens=query_lens, window=draw(st.sampled_from([-1, draw(st.integers(1, 2 * block_size))])),
                seed=draw(st.integers(0, 2**31 - 1)), isa=draw(st.sampled_from(SUPPORTED_ISAS)))


@settings(max_examples=120, deadline=None)
@given(batches())
def test_paged_attention_over_an_int8_cache_matches_the_reference(case):
    """The kernels dequantize each row into the query's dtype: exact in fp32, one bf16
    rounding of each value in bf16 (the reference attends over the fp32 values)."""
    gen = torch.Generator().manual_seed(case["seed"])
    batch = random_batch(gen, case["seq_lens"], case["query_lens"], case["num_heads"], case["num_kv_heads"],
                         case["head_size"], case["block_size"], case["dtype"], cache_dtype=torch.int8)
    out, expected = run_both(batch, case["head_size"] ** -0.5, case["window"], case["isa"])
    torch.testing.assert_close(out, expected, **TOLERANCES[case["dtype"]])


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_key_ranges_and_long_contexts(isa, dtype):
    """One long decode and a chunk: few work items, so the key ranges are split (split-K)."""
    gen = torch.Generator().manual_seed(7)
    batch = random_batch(gen, [1500, 700], [1, 40], 9, 3, 64, 16, dtype, cache_dtype=torch.int8)
    out, expected = run_both(batch, 0.125, -1, isa)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_attention_reads_each_rows_own_scale():
    """Doubling one key row's scale changes only what that row contributes: the kernel must
    read the scale beside the row it reads."""
    gen = torch.Generator().manual_seed(3)
    batch = random_batch(gen, [20], [1], 4, 1, 64, 16, torch.float32, cache_dtype=torch.int8)
    before = torch.zeros_like(batch.query)
    torch.ops.contbatch.paged_attention(before, *batch.attention_args(), 0.125, -1)
    block, offset = int(batch.block_tables[0, 1]), 3  # key position 19
    row = batch.value_cache[block, 0, offset]
    row[-SCALE_BYTES:] = (scales(row.clone()) * 2).reshape(1).view(torch.int8)
    after = torch.zeros_like(batch.query)
    torch.ops.contbatch.paged_attention(after, *batch.attention_args(), 0.125, -1)
    expected = torch.zeros_like(batch.query)
    reference.paged_attention(expected, *batch.attention_args(), 0.125, -1)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, **TOLERANCES[torch.float32])


def test_copy_blocks_copies_rows_and_scales():
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randint(-128, 128, (6, 2, 16, 68), generator=gen, dtype=torch.int8) for _ in range(4)]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([[0, 3], [2, 5]])
    reference.copy_blocks(expected[:2], expected[2:], mapping)
    torch.ops.contbatch.copy_blocks(caches[:2], caches[2:], mapping)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


def test_rejects_an_int8_cache_of_the_wrong_row_length():
    query = torch.zeros(1, 2, 64)
    cache = torch.zeros(2, 1, 16, 64, dtype=torch.int8)  # no room for the scale
    args = (cache, cache.clone(), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.125, -1)
    with pytest.raises(ValueError, match="4-byte scale"):
        torch.ops.contbatch.paged_attention(torch.zeros_like(query), query, *args)
    with pytest.raises(ValueError, match="head_size=60"):  # a 64-byte row holds 60 values and the scale
        torch.ops.contbatch.reshape_and_cache(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), cache, cache.clone(),
                                              torch.zeros(1, dtype=torch.int64))
    odd = torch.zeros(2, 1, 16, 72 + SCALE_BYTES, dtype=torch.int8)
    with pytest.raises(ValueError, match="multiple of 16"):
        torch.ops.contbatch.reshape_and_cache(torch.zeros(1, 1, 72), torch.zeros(1, 1, 72), odd, odd.clone(),
                                              torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="differs from key dtype"):
        torch.ops.contbatch.reshape_and_cache(torch.zeros(1, 1, 60), torch.zeros(1, 1, 60).bfloat16(), cache,
                                              cache.clone(), torch.zeros(1, dtype=torch.int64))
