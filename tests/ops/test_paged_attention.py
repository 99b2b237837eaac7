"""contbatch::paged_attention (csrc/cpu/attention*.cpp) against contbatch.ops.reference."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from contbatch.ops import reference
from tests.ops.paged_batch import (
    SUPPORTED_ISAS,
    TOLERANCES,
    assert_same_at_every_thread_count,
    cpu_isa,
    device_params,
    isa_params,
    num_threads,
    random_batch,
    require_native,
    run_both,
)

require_native()

DTYPES = [torch.float32, torch.bfloat16]


@st.composite
def batches(draw):
    dtype = draw(st.sampled_from(DTYPES))
    block_size = draw(st.sampled_from([8, 16, 32, 48]))
    head_size = draw(st.sampled_from([64, 80, 96, 128, 256]))
    num_kv_heads = draw(st.integers(1, 6))  # work items take up to 4 kv heads
    group = draw(st.sampled_from([1, 2, 3, 4, 8, 32]))  # 32: a group spans several items
    num_seqs = draw(st.integers(1, 4))
    seq_lens, query_lens = [], []
    for _ in range(num_seqs):
        seq_len = draw(st.integers(1, 5 * block_size + 3))
        kind = draw(st.sampled_from(["decode", "prefill", "chunked", "idle"]))
        q_len = {"decode": 1, "prefill": seq_len, "idle": 0}.get(kind) or draw(st.integers(1, seq_len))
        seq_lens.append(seq_len)
        query_lens.append(q_len)
    window = draw(st.sampled_from([-1, 0, draw(st.integers(1, 2 * block_size))]))
    seed = draw(st.integers(0, 2**31 - 1))
    isa = draw(st.sampled_from(SUPPORTED_ISAS))
    return dict(dtype=dtype, block_size=block_size, head_size=head_size, num_kv_heads=num_kv_heads,
                num_heads=group * num_kv_heads, seq_lens=seq_lens, query_lens=query_lens, window=window,
                seed=seed, isa=isa)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_matches_reference_on_random_batches(case):
    gen = torch.Generator().manual_seed(case["seed"])
    batch = random_batch(gen, case["seq_lens"], case["query_lens"], case["num_heads"], case["num_kv_heads"],
                         case["head_size"], case["block_size"], case["dtype"])
    out, expected = run_both(batch, case["head_size"] ** -0.5, case["window"], case["isa"])
    torch.testing.assert_close(out, expected, **TOLERANCES[case["dtype"]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", isa_params())
def test_smollm_decode_batch(dtype, isa):
    """The hot path: SmolLM2-135M's 9 query / 3 kv heads of size 64, ragged contexts."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(100, 700, (32,), generator=gen).tolist()
    batch = random_batch(gen, seq_lens, [1] * 32, 9, 3, 64, 16, dtype)
    out, expected = run_both(batch, 0.125, -1, isa)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("query_len, window", [(1, -1), (1, 300), (5, -1), (5, 300), (40, 100)])
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [(4, 1, 16), (10, 5, 64)])
def test_split_key_ranges(dtype, isa, query_len, window, num_heads, num_kv_heads, block_size):
    """One long sequence: too few work items for this machine's CPUs (when it has 2 or more),
    so key ranges are split and the partial softmaxes merged (with a window, some partitions
    hold no key for some rows). 5 kv heads make one item of 4 kv heads and one of 1, each split."""
    gen = torch.Generator().manual_seed(query_len)
    batch = random_batch(gen, [2500], [query_len], num_heads, num_kv_heads, 64, block_size, dtype)
    with num_threads(2):
        out, expected = run_both(batch, 0.125, window, isa)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("window", [-1, 50])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (8, 2, 80), (12, 1, 128)])
def test_prefill_chunks_of_many_rows(dtype, isa, window, num_heads, num_kv_heads, head_size):
    """Prefill chunks whose work items hold 12-16 rows a kv head (query tokens x the heads
    of a kv head): on the avx512_bf16 tier a bf16 item of 12 or more runs with its rows in
    vector lanes (attention_kernel.h, attend_item_by_lanes). Chunks after earlier tokens, a
    whole prompt, and ragged lengths, so items of fewer rows run beside them."""
    gen = torch.Generator().manual_seed(head_size + window)
    batch = random_batch(gen, [300, 77, 41, 230], [120, 77, 13, 1], num_heads, num_kv_heads, head_size, 16, dtype)
    out, expected = run_both(batch, head_size**-0.5, window, isa)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [-1, 40])
def test_device_kernel_matches_reference(device, dtype, window):
    """Decode, prefill, a chunk and an idle sequence in one batch, on each device's kernel
    (CUDA: csrc/cuda/attention.cu) against the reference computed on the CPU in fp32."""
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("fp16 is refused on the CPU")
    gen = torch.Generator().manual_seed(4)
    batch = random_batch(gen, [300, 45, 90, 17], [1, 45, 30, 0], 8, 2, 64, 16, dtype)
    expected = torch.zeros_like(batch.query, dtype=torch.float32)
    as_fp32 = [t.float() if t.is_floating_point() else t for t in batch.attention_args()]
    reference.paged_attention(expected, *as_fp32, 0.125, window)
    on_device = batch.to(device)
    out = torch.full_like(on_device.query, float("nan"))
    torch.ops.contbatch.paged_attention(out, *on_device.attention_args(), 0.125, window)
    tolerance = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(out.cpu().float(), expected, **tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("seq_lens, query_lens", [([2500], [1]), ([900, 40], [1, 40]), ([700] * 5, [1] * 5)])
def test_the_same_at_every_thread_count(dtype, isa, seq_lens, query_lens):
    """Few long sequences, which split-K cuts into partitions (their partial softmaxes summed in
    another order than one pass): the cut must not follow the threads of the moment. Before,
    it was sized for them, and one decode sequence of 2,500 keys came out differently at 1,
    2 and 3 threads."""
    gen = torch.Generator().manual_seed(len(seq_lens))
    batch = random_batch(gen, seq_lens, query_lens, 9, 3, 64, 16, dtype)

    def call() -> torch.Tensor:
        out = torch.empty_like(batch.query)
        with cpu_isa(isa):
            torch.ops.contbatch.paged_attention(out, *batch.attention_args(), 0.125, -1)
        return out

    assert_same_at_every_thread_count(call)


@pytest.mark.parametrize("isa", isa_params())
def test_single_thread_matches(isa):
    gen = torch.Generator().manual_seed(1)
    batch = random_batch(gen, [2000, 30], [1, 30], 8, 2, 128, 16, torch.float32)
    with num_threads(1):
        out, expected = run_both(batch, 0.1, -1, isa)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_strided_query_and_out():
    """query and out may be views (e.g. split from a fused qkv projection)."""
    gen = torch.Generator().manual_seed(2)
    batch = random_batch(gen, [40, 17], [3, 17], 4, 2, 64, 16, torch.float32)
    qkv = torch.randn(20, 8, 64, generator=gen)
    qkv[:, :4] = batch.query
    batch.query = qkv[:, :4]
    expected = torch.zeros(20, 4, 64)
    reference.paged_attention(expected, *batch.attention_args(), 0.125)
    out_storage = torch.full((20, 8, 64), float("nan"))
    torch.ops.contbatch.paged_attention(out_storage[:, 2:6], *batch.attention_args(), 0.125)
    torch.testing.assert_close(out_storage[:, 2:6], expected, **TOLERANCES[torch.float32])
    assert out_storage[:, :2].isnan().all() and out_storage[:, 6:].isnan().all()


def test_idle_sequences_and_empty_batch_leave_out_untouched():
    gen = torch.Generator().manual_seed(3)
    batch = random_batch(gen, [10, 20], [0, 0], 2, 1, 64, 8, torch.float32)
    out = torch.full((4, 2, 64), 7.0)
    torch.ops.contbatch.paged_attention(out, batch.query.new_zeros(4, 2, 64), *batch.attention_args()[1:], 1.0)
    assert (out == 7.0).all()


def bad_input_cases():
    gen = torch.Generator().manual_seed(4)
    base = random_batch(gen, [20], [4], 4, 2, 64, 16, torch.float32)
    args = list(base.attention_args())

    def with_arg(i, value):
        changed = list(args)
        changed[i] = value
        return changed

    bad_table = base.block_tables.clone()
    bad_table[0, 0] = base.key_cache.shape[0]
    return [
        ("fp16", TypeError, [a.half() if i in (0, 1, 2) else a for i, a in enumerate(args)]),
        ("head_size 72", ValueError, [torch.randn(4, 4, 72), torch.randn(5, 2, 16, 72), torch.randn(5, 2, 16, 72),
                                      *args[3:]]),
        ("5 heads over 2 kv heads", ValueError, with_arg(0, torch.randn(4, 5, 64))),
        ("int64 block table", TypeError, with_arg(3, base.block_tables.long())),
        ("block id past the cache", ValueError, with_arg(3, bad_table)),
        ("more queries than context", ValueError, with_arg(4, torch.tensor([3], dtype=torch.int32))),
        ("context past the block table", ValueError, with_arg(4, torch.tensor([100], dtype=torch.int32))),
        ("query_start_loc past the tokens", ValueError, with_arg(5, torch.tensor([0, 9], dtype=torch.int32))),
        ("query_start_loc of the wrong length", ValueError, with_arg(5, torch.tensor([0], dtype=torch.int32))),
    ]


@pytest.mark.parametrize("name, error, args", bad_input_cases(), ids=[c[0] for c in bad_input_cases()])
def test_rejects_bad_input(name, error, args):
    out = torch.empty_like(args[0])
    with pytest.raises(error):
        torch.ops.contbatch.paged_attention(out, *args, 0.125)


def test_registered_for_cpu_with_default_window():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("contbatch::paged_attention", "CPU")
    schema = str(torch.ops.contbatch.paged_attention.default._schema)
    assert "int sliding_window=-1" in schema
