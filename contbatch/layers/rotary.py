"""Rotary position embeddings (default, linear and Llama 3 scaling), cached per position."""

import math

import torch

from contbatch import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, computed once in fp32.

    Built after the model's weights are materialised (it holds no parameters) and
    indexed by absolute position, so a varlen batch needs no per-sequence work.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        scaling: dict | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq = _inverse_frequencies(head_dim, base, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place."""
        ops.rotary_embedding(positions, q, k, self.cos, self.sin)
        return q, k


def _inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short kept, the band between interpolated."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
