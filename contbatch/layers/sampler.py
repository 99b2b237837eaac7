"""Sampler: next tokens for a batch of rows, each with its own sampling settings.

Vectorised over the batch; only seeded rows draw their uniform one by one, from
their own generator, so a seeded request samples the same tokens whatever else
shares its batch. A sampled row draws one uniform and takes the token where it falls in
the row's cumulative weights (inverse CDF, over sums of blocks and then within one block:
``ops.sample_rows``): exact sampling, one pass over the vocabulary, and no noise per token.

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
    """The fp32 buffer the sampler copies a step's logits into when penalties or biases need
    them in fp32, kept from step to step by its owner (the model runner): a fresh [rows, vocab]
    tensor each step is faulted in page by page (50 MB for 256 rows of a 49k vocabulary, ~20 ms
    on this project's VMs), more than the arithmetic on it."""

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

    Masks (-inf) and argmax are exact in bf16, and so are the weights the sampling op computes
    from bf16 logits in fp32: only penalties and biases need an fp32 copy of the logits (in
    ``scratch`` if given). Sampled rows draw by inverse CDF from one uniform each
    (``ops.sample_rows``: one fused kernel a row on the CPU).
    """
    logits = _restricted_logits(logits, batch, scratch)
    if batch.all_greedy:
        tokens = argmax(logits)
        return Sampled(tokens, _rows_without_tokens(logits, tokens, batch))
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    uniform = _uniforms(batch.generators, generator).to(logits.device)
    ops.sample_rows(tokens, logits, batch.temperatures, batch.top_k, batch.top_p, batch.min_p, uniform)
    without = tokens < 0
    if not bool(without.any()):
        return Sampled(tokens, [])
    return Sampled(tokens.clamp_(min=0), without.nonzero().flatten().tolist())


def _restricted_logits(logits: torch.Tensor, batch: SamplingBatch, scratch: SamplerScratch | None) -> torch.Tensor:
    """The logits after allowed ids, bad words and min_tokens, biases, penalties and grammar masks."""
    if batch.penalties is not None or batch.bias is not None:
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


def _rows_without_tokens(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[int]:
    """Greedy rows whose argmax is -inf: only a row its masks left without any token gets one.
    Only rows some mask touched are read: one logit each."""
    rows = {row for row, _ in batch.allowed} | {row for row, _ in batch.suppressed}
    if batch.masked is not None:
        rows.update(batch.masked[0])
    if not rows:
        return []
    index = torch.tensor(sorted(rows), device=tokens.device)
    stuck = logits[index, tokens[index]].isneginf().nonzero().flatten()
    return index[stuck].tolist()


def _uniforms(generators: list[torch.Generator | None], generator: torch.Generator | None) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64; a seeded row's from its own generator, so that
    its token does not depend on the rest of the batch."""
    uniform = torch.rand(len(generators), generator=generator, dtype=torch.float64)
    for row, row_generator in enumerate(generators):
        if row_generator is not None:
            uniform[row] = torch.rand(1, generator=row_generator, dtype=torch.float64)
    return uniform


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


