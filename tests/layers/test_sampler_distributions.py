"""The sampler draws from exactly the distribution its settings define: temperature, top-k,
top-p, min-p and their combination, and greedy rows beside sampled ones.

Every test samples one batch of many rows that share the same logits (one draw per row) and
compares the token counts with probabilities computed here in float64 from the definitions
in SamplingParams' docstring, not by our code. Tokens a setting removes must never appear;
each kept token's count must lie within a Bernstein bound whose false-failure probability,
over all tokens of a test, is below FALSE_FAILURE. The generator is seeded, so a test gives
the same counts on every run.
"""

import math

import pytest
import torch

from contbatch import SamplingParams
from contbatch.layers.sampler import SamplingBatch, sample

ROWS = 100_000
FALSE_FAILURE = 1e-6
# Probabilities placed out of order in the vocabulary, so that a kept set must be found by
# sorting and scattered back: the top-p and min-p cases below sit well away from their cut-offs.
PROBS = [0.0625, 0.5, 0.025, 0.25, 0.125, 0.0375]
LOGITS = [math.log(p) for p in PROBS]
SPREAD = [1.2, -0.3, 2.5, 0.4, 2.0, -1.0, 0.9, 1.7]  # top 4 at temperature 0.8: tokens 2, 4, 7, 0


def _batch(params: list[SamplingParams]) -> SamplingBatch:
    """The only place this file builds a SamplingBatch: no per-request generators, nothing
    suppressed, no structured-output masks, no penalties."""
    rows = len(params)
    return SamplingBatch.build(params, [None] * rows, [], None, [([], [])] * rows, torch.device("cpu"))


def _draw(logits: list[float], params: list[SamplingParams]) -> torch.Tensor:
    """One token per row of ``params``, every row with ``logits``."""
    batch_logits = torch.tensor(logits, dtype=torch.float32).expand(len(params), -1).clone()
    return sample(batch_logits, _batch(params), torch.Generator().manual_seed(0)).tokens


def _softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    top = max(logits)
    weights = [math.exp((value - top) / temperature) for value in logits]
    return [weight / sum(weights) for weight in weights]


def _keep(probs: list[float], kept: set[int]) -> list[float]:
    """``probs`` restricted to ``kept`` and renormalised."""
    total = sum(probs[token] for token in kept)
    return [probs[token] / total if token in kept else 0.0 for token in range(len(probs))]


def _by_probability(probs: list[float]) -> list[int]:
    return sorted(range(len(probs)), key=lambda token: -probs[token])


def _top_k(probs: list[float], k: int) -> list[float]:
    return _keep(probs, set(_by_probability(probs)[:k]))


def _top_p(probs: list[float], top_p: float) -> list[float]:
    """The smallest set of most likely tokens whose probability sums to at least ``top_p``
    (vLLM's set too: it drops a token when that token and the less likely ones hold at
    most 1 - top_p). Exactly at a boundary float rounding decides, so no case here sits on one."""
    kept, mass = set(), 0.0
    for token in _by_probability(probs):
        kept.add(token)
        mass += probs[token]
        if mass >= top_p:
            break
    return _keep(probs, kept)


def _min_p(probs: list[float], min_p: float) -> list[float]:
    return _keep(probs, {token for token, p in enumerate(probs) if p >= min_p * max(probs)})


def _assert_drawn_from(tokens: torch.Tensor, expected: list[float]) -> None:
    """Tokens of probability 0 never drawn; every other count within its Bernstein bound:
    P(|count - n p| >= t) <= 2 exp(-t^2 / (2 (n p (1 - p) + t / 3))), at FALSE_FAILURE / vocab each."""
    n, vocab = tokens.numel(), len(expected)
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    assert len(counts) == vocab, f"token ids past the vocabulary: {counts[vocab:]}"
    log_term = math.log(2 * vocab / FALSE_FAILURE)
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert count == 0, f"token {token} should never be drawn, drawn {count} times; counts {counts}"
            continue
        bound = log_term / 3 + math.sqrt((log_term / 3) ** 2 + 2 * n * p * (1 - p) * log_term)
        assert abs(count - n * p) < bound, (
            f"token {token}: {count} draws of {n}, expected {n * p:.0f} +- {bound:.0f} (p = {p:.4f}); "
            f"counts {counts}, expected {[round(q * n) for q in expected]}"
        )


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_temperature_samples_the_softmax_of_the_scaled_logits(temperature):
    """temperature 1 is the inverse-CDF draw itself: each token drawn with its softmax
    probability, a 0.2% token included."""
    logits = SPREAD[:5] + [-3.0, 0.0, 1.0]
    tokens = _draw(logits, [SamplingParams(temperature=temperature)] * ROWS)
    _assert_drawn_from(tokens, _softmax(logits, temperature))


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_top_k_keeps_the_k_most_likely_tokens(k):
    tokens = _draw(SPREAD, [SamplingParams(top_k=k)] * ROWS)
    _assert_drawn_from(tokens, _top_k(_softmax(SPREAD), k))


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, 1),  # the most likely token alone holds more: it always stays
        (0.749, 2),  # 0.5 + 0.25 reaches it
        (0.751, 3),  # 0.5 + 0.25 falls just short: the token that crosses it is kept too
        (0.95, 5),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, kept):
    expected = _top_p(PROBS, top_p)
    assert sum(p > 0 for p in expected) == kept  # the case is what its comment says
    _assert_drawn_from(_draw(LOGITS, [SamplingParams(top_p=top_p)] * ROWS), expected)


@pytest.mark.parametrize("min_p, temperature", [(0.2, 1.0), (0.1, 1.0), (0.3, 2.0)])
def test_min_p_drops_tokens_below_min_p_times_the_most_likely(min_p, temperature):
    tokens = _draw(LOGITS, [SamplingParams(min_p=min_p, temperature=temperature)] * ROWS)
    _assert_drawn_from(tokens, _min_p(_softmax(LOGITS, temperature), min_p))


def test_temperature_then_top_k_then_top_p_on_what_top_k_kept():
    """top-p measures mass within the top-k tokens: over the whole distribution, 0.85 would
    also keep token 0 (0.43 + 0.23 + 0.16 = 0.81 < 0.85), within the top 4 it needs only three."""
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.85)
    expected = _top_p(_top_k(_softmax(SPREAD, 0.8), 4), 0.85)
    assert expected[0] == 0.0 and _top_p(_softmax(SPREAD, 0.8), 0.85)[0] > 0
    _assert_drawn_from(_draw(SPREAD, [params] * ROWS), expected)


def test_each_row_follows_its_own_settings():
    """Rows with different settings in one batch: greedy rows stay the argmax (token 2) and
    every sampled row draws from its own distribution."""
    groups = [
        (SamplingParams(temperature=0), [0.0] * 2 + [1.0] + [0.0] * 5),
        (SamplingParams(temperature=1.0), _softmax(SPREAD)),
        (SamplingParams(temperature=0.5), _softmax(SPREAD, 0.5)),
        (SamplingParams(top_k=2), _top_k(_softmax(SPREAD), 2)),
        (SamplingParams(top_p=0.6), _top_p(_softmax(SPREAD), 0.6)),
        (SamplingParams(min_p=0.4), _min_p(_softmax(SPREAD), 0.4)),
    ]
    rows = ROWS // 2
    params = [group for group, _ in groups for _ in range(rows)]
    params = [params[i] for i in torch.randperm(len(params), generator=torch.Generator().manual_seed(1))]
    tokens = _draw(SPREAD, params)
    for group, expected in groups:
        _assert_drawn_from(tokens[[i for i, p in enumerate(params) if p is group]], expected)


def test_min_p_before_top_p_as_vllm_orders_them():
    """vLLM applies min-p after the temperature and before top-k/top-p, so top-p measures
    mass among the tokens min-p kept: min-p 0.2 keeps 0.5, 0.25 and 0.125, and within them
    (0.57, 0.29, 0.14) top-p 0.8 needs two tokens, where over the whole distribution it
    would need three."""
    params = SamplingParams(min_p=0.2, top_p=0.8)
    expected = _top_p(_min_p(PROBS, 0.2), 0.8)
    assert sum(p > 0 for p in expected) == 2 and sum(p > 0 for p in _min_p(_top_p(PROBS, 0.8), 0.2)) == 3
    _assert_drawn_from(_draw(LOGITS, [params] * ROWS), expected)


# A vocabulary of several of the sampler's blocks and a part-block (1,000 tokens), with
# probabilities spread over all of it: the cases above fit in one block and in the first
# top-k/top-p candidates, these do not.
WIDE = [float(v) for v in torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 1.5]


def _draw_wide(params: SamplingParams) -> torch.Tensor:
    return _draw(WIDE, [params] * ROWS)


def test_a_vocabulary_of_several_blocks_is_drawn_from_exactly():
    _assert_drawn_from(_draw_wide(SamplingParams(temperature=1.0)), _softmax(WIDE))


def test_top_p_past_the_first_candidates():
    """top_p 0.9 of this distribution needs hundreds of tokens: more than the first candidates."""
    expected = _top_p(_softmax(WIDE, 0.9), 0.9)
    assert sum(p > 0 for p in expected) > 300
    _assert_drawn_from(_draw_wide(SamplingParams(temperature=0.9, top_p=0.9)), expected)


def test_a_large_top_k_then_top_p():
    """top-p's mass is measured among the 300 that top-k keeps, which are more than the first candidates."""
    expected = _top_p(_top_k(_softmax(WIDE), 300), 0.8)
    assert 64 < sum(p > 0 for p in expected) < 300
    _assert_drawn_from(_draw_wide(SamplingParams(top_k=300, top_p=0.8)), expected)
