"""Sampler: next tokens for a batch of rows, each with its own sampling settings.

Vectorised over the batch; only seeded rows draw their noise one by one, from
their own generator, so a seeded request samples the same tokens whatever else
shares its batch. Sampling uses the exponential-race trick (argmax of p / q with
q ~ Exp(1)), which draws from p exactly and needs no cumulative sums.
"""

from dataclasses import dataclass

import torch

from contbatch.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor  # [rows] float32, 0 = greedy
    top_k: torch.Tensor  # [rows] int64, 0 = off
    top_p: torch.Tensor  # [rows] float32, 1 = off
    min_p: torch.Tensor  # [rows] float32, 0 = off
    generators: list[torch.Generator | None]
    suppressed: list[tuple[int, list[int]]]  # (row, token ids masked out: min_tokens not yet reached)
    all_greedy: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        suppressed: list[tuple[int, list[int]]],
        device: torch.device,
    ) -> "SamplingBatch":
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            generators=generators,
            suppressed=suppressed,
            all_greedy=all(p.greedy for p in params),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [rows] from fp32 logits [rows, vocab]."""
    for row, token_ids in batch.suppressed:
        logits[row, token_ids] = float("-inf")
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    greedy = batch.temperatures == 0
    logits = logits / torch.where(greedy, 1.0, batch.temperatures).unsqueeze(1)
    logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = torch.softmax(logits, dim=-1)
    if bool((batch.min_p > 0).any()):
        threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = _exponential_noise(probs, batch.generators, generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, sampled)


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
