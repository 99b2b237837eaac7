"""Rotary position embeddings (default, linear, Llama 3 and LongRoPE scaling), cached per position."""

import math

import torch

from contbatch import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, computed once in fp32.

    Built after the model's weights are materialised (it holds no parameters) and
    indexed by absolute position, so a varlen batch needs no per-sequence work.
    ``rotary_dim`` is how many leading dims of each head rotate (partial rotary); the rest
    pass through.
    """

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        base: float,
        scaling: dict | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.rotary_dim = rotary_dim
        if _rope_type(scaling) == "longrope":
            inv_freq = _longrope_frequencies(rotary_dim, base, scaling, max_positions)
            attention_factor = float(scaling["attention_factor"])
        else:
            inv_freq, attention_factor = _inverse_frequencies(rotary_dim, base, scaling), 1.0
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # transformers scales cos and sin in fp32, before the cast.
        self.cos = (emb.cos() * attention_factor).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * attention_factor).to(dtype=dtype, device=device)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place
        (their first rotary_dim dims: the kernels take the strided views as they are)."""
        if self.rotary_dim == q.shape[-1]:  # whole heads rotate: no slicing (~3 us a layer)
            ops.rotary_embedding(positions, q, k, self.cos, self.sin)
        else:
            ops.rotary_embedding(positions, q[..., : self.rotary_dim], k[..., : self.rotary_dim], self.cos, self.sin)
        return q, k


def _rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = _rope_type(scaling)
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


def _longrope_frequencies(rotary_dim: int, base: float, scaling: dict, max_positions: int) -> torch.Tensor:
    """Phi-3's LongRoPE: each frequency divided by its own factor, from the long set when
    sequences may outgrow original_max_position_embeddings, else from the short set.

    transformers switches sets per forward call, by the call's longest position, and keeps
    the keys it cached before the switch. Done per step here, a prompt's keys would rotate
    one way when prefilled whole, another in chunks or after a cached prefix, and a shared
    cache block would hold whichever its first request left. So the choice is made once, by
    the context length the engine allows (max_model_len), as vLLM makes it: at or below
    original_max_position_embeddings every token takes the short factors, as transformers
    does for sequences within it; above it every token takes the long ones, as transformers
    does for prompts longer than it.
    """
    use_long = max_positions > int(scaling["original_max_position_embeddings"])
    factors = torch.tensor(scaling["long_factor" if use_long else "short_factor"], dtype=torch.float32)
    if factors.numel() != rotary_dim // 2:
        raise ValueError(f"longrope factors: {factors.numel()} given, {rotary_dim // 2} needed for "
                         f"{rotary_dim} rotary dims")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (factors * base**exponents)
