"""Sampler: next tokens for a batch of rows, each with its own sampling settings.

Vectorised over the batch; only seeded rows draw their noise one by one, from
their own generator, so a seeded request samples the same tokens whatever else
shares its batch. Sampling uses the exponential-race trick (argmax of p / q with
q ~ Exp(1)), which draws from p exactly and needs no cumulative sums.

Order of operations on the logits: allowed_token_ids, then bad words and min_tokens
suppression, logit_bias, penalties, grammar masks, then greedy argmax or temperature,
min-p, top-k, top-p and sampling (vLLM's order).
"""

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
    ) -> "SamplingBatch":
        """``token_ids``: (prompt ids, output ids) per row, used only when a row has penalties.
        ``allowed``: (row, token ids) of the rows with allowed_token_ids, as tensors on ``device``."""

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
            bias=_logit_bias(params, device),
        )


def _logit_bias(params: list[SamplingParams], device: torch.device) -> LogitBias | None:
    rows, token_ids, values = [], [], []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows.extend([row] * len(p.logit_bias))
            token_ids.extend(p.logit_bias)
            values.extend(p.logit_bias.values())
    if not rows:
        return None
    return LogitBias(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [rows] int64
    rows_without_tokens: list[int]  # rows whose masks left no token: their entry in tokens means nothing


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> Sampled:
    """Token ids [rows] from logits [rows, vocab] in the model's dtype (modified in place).

    Greedy rows without penalties or biases need no fp32 copy: masking with -inf and argmax
    are exact in bf16. Everything else works on an fp32 copy.
    """
    tokens, masked_logits = _sample(logits, batch, generator)
    return Sampled(tokens, _rows_without_tokens(masked_logits, tokens, batch))


def _sample(
    logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens, and the logits after every mask, bias and penalty (before temperature)."""
    if not batch.all_greedy or batch.penalties is not None or batch.bias is not None:
        logits = logits.float()
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
    greedy_tokens = argmax(logits)
    if batch.all_greedy:
        return greedy_tokens, logits
    masked_logits = logits
    greedy = batch.temperatures == 0
    logits = logits / torch.where(greedy, 1.0, batch.temperatures).unsqueeze(1)
    # vLLM's order: min-p on the tempered distribution, then top-k and top-p on what it kept.
    if bool((batch.min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = torch.softmax(logits, dim=-1)
    noise = _exponential_noise(probs, batch.generators, generator)
    sampled = argmax(probs / noise)
    return torch.where(greedy, greedy_tokens, sampled), masked_logits


def _rows_without_tokens(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[int]:
    """Masked rows whose every logit is -inf (allowed_token_ids against bad words, say): the
    argmax of such a row, or of its NaN probabilities, picks a token at -inf. Only rows some
    mask touched are read: one logit each."""
    rows = {row for row, _ in batch.allowed} | {row for row, _ in batch.suppressed}
    if batch.masked is not None:
        rows.update(batch.masked[0])
    if not rows:
        return []
    index = torch.tensor(sorted(rows), device=logits.device)
    stuck = torch.isneginf(logits[index, tokens[index]]).nonzero().flatten()
    return index[stuck].tolist()


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


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1).any())
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        drop |= (ranks >= top_k.unsqueeze(1)) & (top_k.unsqueeze(1) > 0)
    if use_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None], generator: torch.Generator | None
) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, row_generator in enumerate(generators):
        if row_generator is not None:
            # Drawn on the CPU from the request's own generator: the same stream on every device.
            noise[row] = torch.empty(probs.shape[1]).exponential_(generator=row_generator).to(probs.device)
    return noise
