"""Sampler: next tokens for a batch of rows, each with its own sampling settings.

Vectorised over the batch; only seeded rows draw their uniform one by one, from
their own generator, so a seeded request samples the same tokens whatever else
shares its batch. A sampled row draws one uniform and takes the token where it falls in
the row's cumulative weights (inverse CDF, over sums of blocks and then within one block):
exact sampling, one pass over the vocabulary, and no noise per token.

Order of operations on the logits: allowed_token_ids, then bad words and min_tokens
suppression, logit_bias, penalties, grammar masks, then greedy argmax or temperature,
min-p, top-k, top-p and sampling (vLLM's order).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from contbatch import ops
from contbatch.sampling_params import SamplingParams


@dataclass
class Penalties:
    repetition: torch.Tensor  # [rows, 1]
    presence: torch.Tensor  # [rows, 1]
    frequency: torch.Tensor  # [rows, 1]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]


@dataclass(frozen=True)
class TokenMasks:
    """Tokens some sequences may not sample next (structured outputs): row i of ``blocked``
    belongs to ``seq_ids[i]``."""

    seq_ids: list[int]
    blocked: torch.Tensor  # [len(seq_ids), vocab_size] bool, True = not allowed


@dataclass(frozen=True)
class LogitBias:
    """Values added to some logits: ``values[i]`` to row ``rows[i]``, column ``token_ids[i]``."""

    rows: torch.Tensor  # [entries] int64
    token_ids: torch.Tensor  # [entries] int64
    values: torch.Tensor  # [entries] float32


@dataclass
class SamplingBatch:
    # Per-row settings, None when every row is greedy (argmax needs none of them).
    temperatures: torch.Tensor | None  # [rows] float32, 0 = greedy
    top_k: torch.Tensor | None  # [rows] int64, 0 = off
    top_p: torch.Tensor | None  # [rows] float32, 1 = off
    min_p: torch.Tensor | None  # [rows] float32, 0 = off
    generators: list[torch.Generator | None]
    suppressed: list[tuple[int, list[int]]]  # (row, token ids masked out: bad words, min_tokens not yet reached)
    masked: tuple[list[int], torch.Tensor] | None  # (rows, [len(rows), vocab] bool: True = not allowed)
    penalties: Penalties | None
    all_greedy: bool
    allowed: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, the only token ids it may take)
    bias: LogitBias | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        suppressed: list[tuple[int, list[int]]],
        masked: tuple[list[int], torch.Tensor] | None,
        token_ids: list[tuple[list[int], list[int]]],
        device: torch.device,
        allowed: list[tuple[int, torch.Tensor]] = (),
        biases: list[tuple[int, torch.Tensor, torch.Tensor]] = (),
    ) -> "SamplingBatch":
        """``token_ids``: (prompt ids, output ids) per row, used only when a row has penalties.
        ``allowed``: (row, token ids) of the rows with allowed_token_ids, as tensors on ``device``;
        ``biases``: (row, token ids, values) of the rows with a logit_bias, likewise."""

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        penalties = None
        if any(p.has_penalties for p in params):
            penalties = Penalties(
                repetition=column([p.repetition_penalty for p in params], torch.float32).unsqueeze(1),
                presence=column([p.presence_penalty for p in params], torch.float32).unsqueeze(1),
                frequency=column([p.frequency_penalty for p in params], torch.float32).unsqueeze(1),
                prompt_ids=[ids[0] for ids in token_ids],
                output_ids=[ids[1] for ids in token_ids],
            )
        all_greedy = all(p.greedy for p in params)
        return cls(
            temperatures=None if all_greedy else column([p.temperature for p in params], torch.float32),
            top_k=None if all_greedy else column([max(p.top_k, 0) for p in params], torch.int64),
            top_p=None if all_greedy else column([p.top_p for p in params], torch.float32),
            min_p=None if all_greedy else column([p.min_p for p in params], torch.float32),
            generators=generators,
            suppressed=suppressed,
            masked=masked,
            penalties=penalties,
            all_greedy=all_greedy,
            allowed=list(allowed),
            bias=_logit_bias(biases, device),
        )


def _logit_bias(biases: list[tuple[int, torch.Tensor, torch.Tensor]], device: torch.device) -> LogitBias | None:
    """The rows' biases as one scatter: tensors joined, not a Python list per entry (a request
    may bias thousands of tokens)."""
    if not biases:
        return None
    rows = torch.tensor([row for row, _, _ in biases], dtype=torch.int64, device=device)
    counts = torch.tensor([len(ids) for _, ids, _ in biases], dtype=torch.int64, device=device)
    return LogitBias(
        rows=rows.repeat_interleave(counts),
        token_ids=torch.cat([ids for _, ids, _ in biases]),
        values=torch.cat([values for _, _, values in biases]),
    )


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [rows] int64
    rows_without_tokens: list[int]  # rows whose masks left no token: their entry in tokens means nothing


class SamplerScratch:
    """The fp32 buffer the sampler copies a step's logits into, kept from step to step by its
    owner (the model runner): a fresh [rows, vocab] tensor each step is faulted in page by page
    (50 MB for 256 rows of a 49k vocabulary, ~20 ms on this project's VMs), more than the
    arithmetic on it."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def fp32_copy(self, logits: torch.Tensor) -> torch.Tensor:
        size = logits.numel()
        if self._buffer is None or self._buffer.numel() < size or self._buffer.device != logits.device:
            self._buffer = torch.empty(size, dtype=torch.float32, device=logits.device)
        return self._buffer[:size].view(logits.shape).copy_(logits)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    generator: torch.Generator | None = None,
    scratch: SamplerScratch | None = None,
) -> Sampled:
    """Token ids [rows] from logits [rows, vocab] in the model's dtype (modified in place).

    Greedy rows without penalties or biases need no fp32 copy: masking with -inf and argmax
    are exact in bf16. Everything else works on an fp32 copy (in ``scratch`` if given).
    Sampled rows draw by inverse CDF from one uniform each; top-k and top-p select among
    each row's largest weights instead of sorting the vocabulary.
    """
    logits = _restricted_logits(logits, batch, scratch)
    greedy_tokens = argmax(logits)
    if batch.all_greedy:
        return Sampled(greedy_tokens, _rows_without_tokens(logits, greedy_tokens, batch, torch.isneginf))
    greedy = batch.temperatures == 0
    weights = _tempered_weights(logits, torch.where(greedy, 1.0, batch.temperatures))
    # vLLM's order: min-p on the tempered distribution, then top-k and top-p on what it kept.
    _apply_min_p(weights, batch.min_p)
    uniform = _uniforms(batch.generators, generator).to(weights.device)
    sampled = torch.empty_like(greedy_tokens)
    narrowed = (batch.top_k > 0) | (batch.top_p < 1)
    top_rows, whole_rows = narrowed.nonzero().flatten(), (~narrowed).nonzero().flatten()
    if top_rows.numel():
        sampled[top_rows] = _draw_top(_take_rows(weights, top_rows), uniform[top_rows], batch.top_k[top_rows],
                                      batch.top_p[top_rows])
    if whole_rows.numel():
        sampled[whole_rows] = _draw(_take_rows(weights, whole_rows), uniform[whole_rows])
    tokens = torch.where(greedy, greedy_tokens, sampled)
    return Sampled(tokens, _rows_without_tokens(weights, tokens, batch, lambda chosen: ~(chosen > 0)))


def _restricted_logits(logits: torch.Tensor, batch: SamplingBatch, scratch: SamplerScratch | None) -> torch.Tensor:
    """The logits after allowed ids, bad words and min_tokens, biases, penalties and grammar masks."""
    if not batch.all_greedy or batch.penalties is not None or batch.bias is not None:
        logits = scratch.fp32_copy(logits) if scratch is not None and logits.dtype != torch.float32 else logits.float()
    for row, token_ids in batch.allowed:
        kept = logits[row, token_ids]
        logits[row] = float("-inf")
        logits[row, token_ids] = kept
    for row, token_ids in batch.suppressed:
        logits[row, token_ids] = float("-inf")
    if batch.bias is not None:
        logits.index_put_((batch.bias.rows, batch.bias.token_ids), batch.bias.values, accumulate=True)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    if batch.masked is not None:
        _apply_masks(logits, *batch.masked)
    return logits


def _rows_without_tokens(
    values: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch, forbidden: Callable[[torch.Tensor], torch.Tensor]
) -> list[int]:
    """Masked rows whose token's value (logit or weight) is ``forbidden`` (-inf, or not above 0):
    only a row its masks left without any token gets one (the argmax of an all -inf row, or a
    draw from no weight). Only rows some mask touched are read: one value each."""
    rows = {row for row, _ in batch.allowed} | {row for row, _ in batch.suppressed}
    if batch.masked is not None:
        rows.update(batch.masked[0])
    if not rows:
        return []
    index = torch.tensor(sorted(rows), device=tokens.device)
    stuck = forbidden(values[index, tokens[index]]).nonzero().flatten()
    return index[stuck].tolist()


def _tempered_weights(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """exp((logits - row max) / temperature), in place on an fp32 copy the sampler owns: the
    unnormalised probabilities, 1 at each row's most likely token. Every pass over [rows, vocab]
    counts here (a step with 256 rows of a 49k vocabulary has 12.6M of them), so no softmax."""
    row_max = logits.amax(dim=-1, keepdim=True)
    return logits.sub_(row_max).div_(temperatures.unsqueeze(1)).exp_()


def _apply_min_p(weights: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero the weights below min_p (the largest weight of a row is 1), a row at a time in
    place: a [rows, vocab] mask would cost a pass and an allocation more."""
    below = torch.nextafter(min_p, torch.tensor(-1.0, device=min_p.device))  # threshold_ keeps weight > below
    for row, (value, threshold) in enumerate(zip(min_p.tolist(), below.tolist())):
        if value > 0:
            torch.nn.functional.threshold_(weights[row], threshold, 0.0)


def _uniforms(generators: list[torch.Generator | None], generator: torch.Generator | None) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64; a seeded row's from its own generator, so that
    its token does not depend on the rest of the batch."""
    uniform = torch.rand(len(generators), generator=generator, dtype=torch.float64)
    for row, row_generator in enumerate(generators):
        if row_generator is not None:
            uniform[row] = torch.rand(1, generator=row_generator, dtype=torch.float64)
    return uniform


def _take_rows(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weights[rows], without the copy when rows are all of them in order (one SamplingParams for all)."""
    return weights if rows.numel() == weights.shape[0] else weights[rows]


TOP_CANDIDATES = 64


def _draw_top(weights: torch.Tensor, uniform: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows with top-k or top-p: drawn among each row's largest weights (a partial selection,
    not a sort of the vocabulary): the k most likely, then the smallest prefix of those whose
    mass reaches top_p of theirs. A top-p prefix not found among the first candidates is
    looked for among 8 times as many."""
    vocab = weights.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    tokens = torch.empty(weights.shape[0], dtype=torch.int64, device=weights.device)
    pending = torch.arange(weights.shape[0], device=weights.device)
    candidates = max(TOP_CANDIDATES, int(k[k < vocab].max()) if bool((k < vocab).any()) else 0)
    while pending.numel():
        candidates = min(candidates, vocab)
        rows = _take_rows(weights, pending)
        values, token_ids = rows.topk(candidates, dim=-1)  # descending
        row_k, row_p = k[pending].unsqueeze(1), top_p[pending].unsqueeze(1)
        ranks = torch.arange(candidates, device=weights.device)
        values = values.masked_fill_(ranks >= row_k, 0.0)
        mass = torch.where(row_k <= candidates, values.sum(dim=-1, keepdim=True), rows.sum(dim=-1, keepdim=True))
        reached = values.cumsum(dim=-1) >= row_p * mass
        any_reached = reached.any(dim=-1, keepdim=True)
        # Every token a candidate and top_p not reached (rounding): all of them stay.
        first_reached = torch.where(any_reached, reached.int().argmax(dim=-1, keepdim=True), candidates - 1)
        last = torch.where(row_p >= 1, row_k - 1, first_reached)
        found = ((row_p >= 1) | any_reached | (candidates == vocab)).flatten()
        values = values.masked_fill_(ranks > last, 0.0)
        picked = _inverse_cdf(values[found], uniform[pending[found]])
        tokens[pending[found]] = token_ids[found].gather(1, picked.unsqueeze(1)).flatten()
        pending, candidates = pending[~found], candidates * 8
    return tokens


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows] column of each row with probability weight / row sum, for a uniform per row: the
    first column whose cumulative weight passes uniform x the total, in float64 so that the
    target never reaches the total. Rounding can leave it past the last column of weight:
    then that column."""
    cdf = weights.double().cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)
    columns = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, columns, 0).amax(dim=-1, keepdim=True)
    return torch.where(weights.gather(1, picked) > 0, picked, last_positive).flatten()


DRAW_BLOCK = 256


def _draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row with probability weight / row sum: the inverse CDF in two levels, sums
    of blocks of DRAW_BLOCK tokens (one pass over the vocabulary), then the chosen block."""
    rows, vocab = weights.shape
    whole = vocab // DRAW_BLOCK * DRAW_BLOCK
    block_sums = weights[:, :whole].reshape(rows, -1, DRAW_BLOCK).sum(dim=-1)
    if whole < vocab:
        block_sums = torch.cat([block_sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    block = _inverse_cdf(block_sums, uniform).unsqueeze(1)
    block_cdf = block_sums.double().cumsum(dim=-1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    within = ((uniform.unsqueeze(1) * block_cdf[:, -1:] - before) / block_sums.gather(1, block).double()).flatten()
    columns = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=weights.device)
    in_block = torch.where(columns < vocab, weights.gather(1, columns.clamp(max=vocab - 1)), 0.0)
    return (block.flatten() * DRAW_BLOCK + _inverse_cdf(in_block, within.clamp(0.0, 1.0 - 2**-53))).clamp_(max=vocab - 1)


def _apply_masks(logits: torch.Tensor, rows: list[int], blocked: torch.Tensor) -> None:
    if blocked.shape[-1] != logits.shape[-1]:
        raise ValueError(f"logits have {logits.shape[-1]} columns, the token masks {blocked.shape[-1]}")
    blocked = blocked.to(logits.device, non_blocking=True)
    # Row by row in place: cheaper than gathering the rows and scattering them back.
    for i, row in enumerate(rows):
        logits[row].masked_fill_(blocked[i], float("-inf"))


def argmax(rows: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each row's first maximum (torch.argmax's answer), by contbatch's row kernel
    on the CPU (several times faster than PyTorch's on bf16 logits: docs/performance.md)."""
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    ops.argmax_rows(out, rows if rows.stride(-1) == 1 else rows.contiguous())
    return out


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (HF semantics); presence and
    frequency penalties over output tokens (OpenAI semantics)."""
    output_counts = _token_counts(penalties.output_ids, logits)
    seen = (output_counts + _token_counts(penalties.prompt_ids, logits)) > 0
    rep = penalties.repetition
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - penalties.frequency * output_counts - penalties.presence * (output_counts > 0).float()


def _token_counts(token_ids: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] occurrence counts; one scatter over ids padded with an out-of-range column."""
    rows, vocab = like.shape
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((rows, max(width, 1)), vocab, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    counts = torch.zeros(rows, vocab + 1, dtype=like.dtype)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=like.dtype))
    return counts[:, :vocab].to(like.device)


