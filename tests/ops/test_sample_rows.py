"""The sampler's draw (sample_rows, csrc/cpu/sampler.cpp and its PyTorch reference) against the
distribution its settings define, computed here in float64 from the definitions: each row's token
must be the inverse CDF of that distribution at the row's uniform, in token-id order.

Random shapes (one block of 256 tokens, several, a tail), per-row settings mixed in one call,
masked tokens, fully masked rows, NaN logits, both dtypes and every ISA tier this CPU runs. The
native kernel keeps the lower token ids among equal weights at a top-k/top-p cut, as the
float64 definition here does, so bf16 logits (many ties) must match too; the reference keeps the
ties torch.topk lists first, so it is held to fp32 logits (no ties). A uniform within TOLERANCE
of a cumulative boundary may fall either side of it (fp32 weights and sums)."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from contbatch.ops import reference
from tests.ops.paged_batch import cpu_isa, isa_params, require_native

require_native()

native = torch.ops.contbatch
TOLERANCE = 1e-5


def _kept_weights(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """float64 weights of the tokens the settings keep (0 elsewhere), from the definitions: softmax
    at the temperature, min-p against the largest probability, the k largest, then the smallest
    prefix of them, largest first and lower ids first among equals, whose mass reaches top_p."""
    x = row.double()
    n = x.numel()
    finite = ~(x.isnan() | x.isneginf())
    weights = torch.where(finite, torch.exp((x - x[finite].max()) / temperature), 0.0)
    if min_p > 0:
        weights = torch.where(weights >= min_p, weights, 0.0)
    order = torch.sort(weights, descending=True, stable=True).indices  # stable: lower ids first
    k = top_k if 0 < top_k < n else n
    order = order[:k]
    if top_p < 1:
        reached = (weights[order].cumsum(0) >= top_p * weights[order].sum()).nonzero()
        order = order[: int(reached[0]) + 1] if reached.numel() else order
    kept = torch.zeros_like(weights)
    kept[order] = weights[order]
    return kept


def _assert_inverse_cdf(token: int, kept: torch.Tensor, uniform: float, where: str) -> None:
    assert 0 <= token < kept.numel() and kept[token] > 0, f"{where}: token {token} is not one the settings keep"
    cdf = kept.cumsum(0) / kept.sum()
    before = float(cdf[token - 1]) if token > 0 else 0.0
    assert before - TOLERANCE <= uniform <= float(cdf[token]) + TOLERANCE, (
        f"{where}: token {token} covers [{before}, {float(cdf[token])}) of the distribution, the uniform is {uniform}"
    )


def _random_call(draw, dtype: torch.dtype, seed: int):
    """(logits, temperatures, top_k, top_p, min_p, uniform) for a few rows with settings of their own."""
    g = torch.Generator().manual_seed(seed)
    rows = draw(st.integers(1, 6))
    n = draw(st.sampled_from([1, 5, 255, 256, 300, 1000, 4096]))
    scale = draw(st.sampled_from([0.5, 3.0, 8.0]))
    logits = (torch.randn(rows, n, generator=g) * scale).to(dtype)
    settings_of = st.tuples(st.sampled_from([0.0, 0.3, 1.0, 2.0]), st.sampled_from([0, 1, 3, 40, n, n + 5]),
                            st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.05]), st.sampled_from([0.0, 0.0, 0.02, 0.3]))
    rows_settings = [draw(settings_of) for _ in range(rows)]
    for r in range(rows):  # some tokens masked out (bad words, grammars), and NaN, which no draw takes
        masked = torch.randint(0, n, (draw(st.integers(0, n)),), generator=g)
        logits[r, masked] = float("-inf")
        if draw(st.booleans()):
            logits[r, int(torch.randint(0, n, (), generator=g))] = float("nan")
    temperatures, top_k, top_p, min_p = (torch.tensor(column) for column in zip(*rows_settings))
    uniform = torch.rand(rows, generator=g, dtype=torch.float64)
    return logits, temperatures.float(), top_k.long(), top_p.float(), min_p.float(), uniform


def _check_rows(out: torch.Tensor, logits, temperatures, top_k, top_p, min_p, uniform, where: str) -> None:
    for r in range(logits.shape[0]):
        row = logits[r].float()
        if float(temperatures[r]) == 0:  # torch.argmax, NaN counting as the largest; -1 if that is -inf
            expected = int(torch.argmax(row))
            assert int(out[r]) == (-1 if row[expected] == float("-inf") else expected), f"{where}: greedy row {r}"
            continue
        if not bool((row > float("-inf")).any()):  # every token masked out (NaN counts as none)
            assert int(out[r]) == -1, f"{where}: a fully masked row {r} gave token {int(out[r])}, not -1"
            continue
        kept = _kept_weights(row, float(temperatures[r]), int(top_k[r]), float(top_p[r]), float(min_p[r]))
        _assert_inverse_cdf(int(out[r]), kept, float(uniform[r]), f"{where}, row {r}")


@pytest.mark.parametrize("isa", isa_params())
@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_native_draws_the_inverse_cdf_of_the_defined_distribution(isa, dtype, seed, data):
    call = _random_call(data.draw, dtype, seed)
    out = torch.full((call[0].shape[0],), -7, dtype=torch.int64)
    with cpu_isa(isa):
        native.sample_rows(out, *call)
    _check_rows(out, *call, where=f"{isa} {dtype}")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_reference_draws_the_inverse_cdf_of_the_defined_distribution(seed, data):
    logits, *rest = _random_call(data.draw, torch.float32, seed)
    # NaN as -inf (and -inf kept: nan_to_num would make it the lowest float, tying the row's weights).
    logits = torch.where(logits.isnan(), float("-inf"), logits)
    out = torch.full((logits.shape[0],), -7, dtype=torch.int64)
    reference.sample_rows(out, logits.clone(), *rest)
    _check_rows(out, logits, *rest, where="reference")


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.999])
def test_a_whole_vocabulary_matches_the_reference_token_for_token(isa, top_p):
    """SmolLM2's vocabulary (49,152 tokens), 64 rows: fp32 logits have no ties, so the kernel and
    the reference must draw the same token from the same uniform, wide top-p nuclei (found by
    the kernel's selection by mass, not its heap) included."""
    g = torch.Generator().manual_seed(5)
    rows, n = 64, 49152
    logits = torch.randn(rows, n, generator=g) * torch.linspace(0.5, 6.0, rows).unsqueeze(1)
    temperatures = torch.linspace(0.2, 1.5, rows)
    top_k = torch.tensor([0, 50] * (rows // 2))
    top_p_column, min_p = torch.full((rows,), top_p), torch.zeros(rows)
    uniform = torch.rand(rows, generator=g, dtype=torch.float64)
    expected = torch.empty(rows, dtype=torch.int64)
    reference.sample_rows(expected, logits.clone(), temperatures, top_k, top_p_column, min_p, uniform)
    out = torch.empty(rows, dtype=torch.int64)
    with cpu_isa(isa):
        native.sample_rows(out, logits, temperatures, top_k, top_p_column, min_p, uniform)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("implementation", ["native", "reference"])
@pytest.mark.parametrize("top_k", [300, 301, 10_000])
def test_top_k_at_or_past_the_vocabulary_keeps_every_token(implementation, top_k):
    """top_k >= the vocabulary is no top-k: equal logits and evenly spread uniforms must reach every
    token (the reference once drew such rows from their 64 largest weights only)."""
    rows, n = 600, 300
    uniform = (torch.arange(rows, dtype=torch.float64) + 0.5) / rows  # never on a boundary: (2i + 1) / 1200 x 300
    args = (torch.ones(rows), torch.full((rows,), top_k), torch.ones(rows), torch.zeros(rows), uniform)
    out = torch.empty(rows, dtype=torch.int64)
    (native.sample_rows if implementation == "native" else reference.sample_rows)(out, torch.zeros(rows, n), *args)
    assert torch.equal(out, (uniform * n).long())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(out=torch.empty(3, dtype=torch.int64)), "out must be"),
        (lambda a: a.update(temperatures=torch.ones(2, dtype=torch.float64)), "temperatures must be"),
        (lambda a: a.update(top_k=torch.zeros(2, dtype=torch.int32)), "top_k must be"),
        (lambda a: a.update(top_p=torch.ones(3)), "top_p must be"),
        (lambda a: a.update(min_p=torch.zeros(2, 1)), "min_p must be"),
        (lambda a: a.update(uniform=torch.rand(2)), "uniform must be"),
        (lambda a: a.update(logits=torch.zeros(2, 0)), "at least one column"),
        (lambda a: a.update(logits=torch.zeros(2, 8, dtype=torch.float16)), "float16"),
        (lambda a: a.update(logits=torch.zeros(8, 2).T), "contiguous columns"),
    ],
)
def test_bad_arguments_are_refused_naming_them(change, message):
    args = dict(out=torch.empty(2, dtype=torch.int64), logits=torch.zeros(2, 8), temperatures=torch.ones(2),
                top_k=torch.zeros(2, dtype=torch.int64), top_p=torch.ones(2), min_p=torch.zeros(2),
                uniform=torch.rand(2, dtype=torch.float64))
    change(args)
    with pytest.raises((ValueError, TypeError), match=message):
        native.sample_rows(*args.values())
