"""Log-probabilities of chosen tokens and the top-k alternatives, from raw logits."""

from dataclasses import dataclass

import torch


@dataclass
class RawLogprobs:
    """One position: the chosen token's logprob and rank, and the k most likely tokens."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[RawLogprobs]:
    """logits [rows, vocab] fp32 (left untouched), token_ids [rows]; ks[row] alternatives per row."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(max(ks, default=0), dim=-1)
    rows = zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist())
    return [
        RawLogprobs(token, value, rank, ids[:k], values[:k])
        for (token, value, rank, ids, values), k in zip(rows, ks)
    ]
