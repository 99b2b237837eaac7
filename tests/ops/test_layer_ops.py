"""The fused layer ops and argmax_rows (csrc/cpu/layers*.cpp) against their PyTorch references, on random
shapes (sizes with and without a 16-lane tail), both dtypes and every ISA tier this CPU runs.

Tolerances: fp32 2e-6 relative (only the order of the sum of squares and exp's last bit
differ); bf16 on a small share of elements, since a last-bit difference in fp32 can flip a
rounding to bf16: one flip of an intermediate bf16 (rms_norm's x * r, 2^-7 relative at
most), carried through the final product and its own rounding, moves an output by up to
two bf16 steps (seen: -1.9766 against -1.9609 for x = -3.11, weight 1.84), so 2^-6 relative."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from contbatch.ops import reference
from tests.ops.paged_batch import cpu_isa, isa_params, require_native

require_native()

DTYPES = [torch.float32, torch.bfloat16]
SIZES = st.sampled_from([16, 64, 80, 100, 576, 1536, 7])
native = torch.ops.contbatch


def _random(shape, dtype, generator, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def assert_close_to_reference(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert not ours.isnan().any(), "an output element was never written"
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, expected, rtol=2e-6, atol=2e-6)
        return
    ours32, expected32 = ours.float(), expected.float()
    off = ours32 != expected32
    # A rounding flip, possibly of an intermediate carried through one more product and rounding.
    torch.testing.assert_close(ours32, expected32, rtol=2**-6, atol=1e-6)
    assert off.float().mean() <= 0.02, f"{int(off.sum())} of {off.numel()} elements differ from the reference"


@pytest.mark.parametrize("isa", isa_params())
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40), n=SIZES,
       seed=st.integers(0, 2**31 - 1))
def test_rms_norm_matches_reference(dtype, isa, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    x, weight = _random((rows, n), dtype, g, 3.0), _random((n,), dtype, g)
    out, expected = _poisoned(x), torch.empty_like(x)
    reference.rms_norm(expected, x, weight, 1e-5)
    with cpu_isa(isa):
        native.rms_norm(out, x, weight, 1e-5)
    assert_close_to_reference(out, expected)


@pytest.mark.parametrize("isa", isa_params())
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40), n=SIZES,
       strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fused_add_rms_norm_matches_reference(dtype, isa, rows, n, strided, seed):
    g = torch.Generator().manual_seed(seed)
    x, residual, weight = _random((rows, n), dtype, g), _random((rows, n), dtype, g, 4.0), _random((n,), dtype, g)
    if strided:  # rows of a wider buffer
        x = torch.cat([x, _random((rows, 5), dtype, g)], dim=1)[:, :n]
    x_ref, residual_ref = x.clone(), residual.clone()
    reference.fused_add_rms_norm(x_ref, residual_ref, weight, 1e-6)
    with cpu_isa(isa):
        native.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, residual_ref), "the residual add must round exactly as PyTorch's"
    assert_close_to_reference(x, x_ref)


@pytest.mark.parametrize("isa", isa_params())
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40), d=SIZES,
       seed=st.integers(0, 2**31 - 1))
def test_silu_and_mul_matches_reference(dtype, isa, rows, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = _random((rows, 2 * d), dtype, g, 4.0)
    x[0, 0] = -100.0  # e^100 overflows: silu must still be -0, not NaN
    out, expected = _poisoned(x[:, :d]), torch.empty_like(x[:, :d])
    reference.silu_and_mul(expected, x)
    with cpu_isa(isa):
        native.silu_and_mul(out, x)
    assert_close_to_reference(out, expected)


@pytest.mark.parametrize("isa", isa_params())
@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), tokens=st.integers(1, 24),
       heads=st.integers(1, 9), kv_heads=st.integers(1, 3), head_size=st.sampled_from([64, 80, 96, 128, 32]),
       seed=st.integers(0, 2**31 - 1))
def test_rotary_embedding_matches_reference(dtype, isa, tokens, heads, kv_heads, head_size, seed):
    from contbatch.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(head_size, 512, 10000.0, None, dtype, torch.device("cpu"))
    positions = torch.randint(0, 512, (tokens,), generator=g)
    # q and k as views into one fused qkv row, as the model has them.
    qkv = _random((tokens, (heads + 2 * kv_heads) * head_size), dtype, g)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    q_ref, k_ref = q.clone(), k.clone()
    untouched = qkv[:, (heads + kv_heads) * head_size :].clone()
    reference.rotary_embedding(positions, q_ref, k_ref, rotary.cos, rotary.sin)
    with cpu_isa(isa):
        native.rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    assert_close_to_reference(q, q_ref)
    assert_close_to_reference(k, k_ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], untouched), "v must not be touched"


@pytest.mark.parametrize("isa", isa_params())
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 12),
       n=st.sampled_from([1, 7, 16, 33, 100, 1536, 49152]), ties=st.integers(0, 3),
       special=st.sampled_from(["none", "nan", "all_-inf", "+inf"]), seed=st.integers(0, 2**31 - 1))
def test_argmax_rows_matches_torch_max(dtype, isa, rows, n, ties, special, seed):
    g = torch.Generator().manual_seed(seed)
    logits = _random((rows, n), dtype, g, 3.0)
    # Copies of each row's maximum at random columns: the first of them must win.
    for r in range(rows):
        top = logits[r].max()
        logits[r, torch.randint(0, n, (ties,), generator=g)] = top
    row = int(torch.randint(0, rows, (), generator=g))
    columns = torch.randint(0, n, (2,), generator=g)
    if special == "nan":  # torch.max counts NaN as the largest value
        logits[row, columns] = float("nan")
    elif special == "all_-inf":  # a row fully masked out (grammar, min_tokens)
        logits[row] = float("-inf")
    elif special == "+inf":
        logits[row, columns] = float("inf")
    expected = torch.empty(rows, dtype=torch.int64)
    reference.argmax_rows(expected, logits)
    assert torch.equal(expected, torch.argmax(logits, dim=-1))  # the semantics the sampler needs
    out = torch.full((rows,), -1, dtype=torch.int64)
    with cpu_isa(isa):
        native.argmax_rows(out, logits)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: native.rms_norm(torch.empty(2, 8), torch.empty(2, 8), torch.empty(7), 1e-5), "weight"),
        (lambda: native.rms_norm(torch.empty(2, 8), torch.empty(2, 8, dtype=torch.float64), torch.empty(8), 1e-5),
         "dtype"),
        (lambda: native.silu_and_mul(torch.empty(2, 3), torch.empty(2, 8)), "input must be"),
        (lambda: native.argmax_rows(torch.empty(3, dtype=torch.int64), torch.empty(2, 8)), "out must be"),
        (lambda: native.argmax_rows(torch.empty(2, dtype=torch.int32), torch.empty(2, 8)), "int64"),
        (lambda: native.argmax_rows(torch.empty(2, dtype=torch.int64), torch.empty(2, 0)), "at least one column"),
        (lambda: native.rotary_embedding(torch.tensor([0, 600]), torch.empty(2, 1, 8), torch.empty(2, 1, 8),
                                         torch.empty(512, 8), torch.empty(512, 8)), "positions\\[1\\] = 600"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        call()


def test_model_layers_use_the_fused_ops_when_built():
    from contbatch import ops

    assert ops.BACKEND == "native"
    x = torch.randn(3, 16)
    out_native, out_ref = torch.empty_like(x), torch.empty_like(x)
    ops.rms_norm(out_native, x, torch.ones(16), 1e-5)
    reference.rms_norm(out_ref, x, torch.ones(16), 1e-5)
    torch.testing.assert_close(out_native, out_ref)
    assert ops.rms_norm is not reference.rms_norm
