"""contbatch's paged attention as an attention implementation of transformers, ``contbatch_paged``.

transformers' modeling files look attention up in a registry by ``config._attn_implementation``
and pass every keyword argument of the model's forward down to it. So each step's KV caches
and ``AttentionMetadata`` travel as one forward keyword, ``contbatch_step``, with no global
state; the function finds its layer's cache and metadata by ``module.layer_idx``, writes the new K/V there
and runs the same ``PagedAttention`` as the native models. Its mask builder builds nothing:
the kernels mask by each sequence's context and window.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from contbatch.layers.attention import AttentionMetadata, KVCache, PagedAttention

ATTENTION_NAME = "contbatch_paged"


@dataclass(frozen=True)
class PagedStep:
    """One step's paged-attention inputs, handed to every layer through the forward's kwargs."""

    attention: Sequence[PagedAttention]  # per layer, with its window
    kv_caches: Sequence[KVCache]
    metadata: Sequence[AttentionMetadata]  # per layer: its KV-cache group's block tables and slots


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    contbatch_step: PagedStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q/k/v ``[1, heads, tokens, head_dim]`` in,
    ``[1, tokens, heads, head_dim]`` out (and no attention weights)."""
    if contbatch_step is None:
        raise ValueError(f"{type(module).__name__} was called without contbatch's step: this model does not "
                         "pass its forward's keyword arguments down to attention")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx, so its KV cache cannot be found")
    attention = contbatch_step.attention[layer]
    problem = _unsupported_call(module, attention, key, attention_mask, kwargs)
    if problem is not None:
        raise ValueError(f"{type(module).__name__} (layer {layer}) {problem}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [tokens, heads, head_dim] views
    # Models pass their own scale with each call: Granite's attention_multiplier, GPT-2's
    # scale_attn_by_inverse_layer_idx, Gemma's query_pre_attn_scalar.
    out = attention(q, k, v, contbatch_step.kv_caches[layer], contbatch_step.metadata[layer], scale=scaling)
    return out.unsqueeze(0), None


def _unsupported_call(
    module: nn.Module, attention: PagedAttention, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict
) -> str | None:
    """Why this call asks for attention the paged kernels do not compute; None if they do."""
    if kwargs.get("softcap") is not None:
        return "needs attention softcapping, which contbatch's paged attention kernels lack"
    if kwargs.get("s_aux") is not None:
        return "needs attention sinks, which contbatch's paged attention kernels lack"
    if not getattr(module, "is_causal", True):
        return "is not causal; contbatch's paged attention kernels are"
    if mask is not None:
        return "built its own attention mask; the paged kernels mask by sequence and window only"
    window = kwargs.get("sliding_window")
    if window is not None and window != attention.sliding_window:
        return f"asks for sliding window {window}, but its config gives {attention.sliding_window}"
    if key.shape[1] != attention.num_kv_heads or key.shape[3] != attention.head_dim:
        return (f"has {key.shape[1]} K/V heads of {key.shape[3]}, but its config gives "
                f"{attention.num_kv_heads} of {attention.head_dim} (the KV cache's shape)")
    return None


def no_dense_mask(*args, **kwargs) -> None:
    """Mask builder of ``contbatch_paged``: the paged kernels mask by each sequence's context and
    window, so transformers builds no mask tensor."""
    return None


@functools.cache
def register_paged_attention() -> None:
    """Make ``contbatch_paged`` an attention implementation transformers knows (once, at first load)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, no_dense_mask)
