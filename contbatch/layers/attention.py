"""Attention over the paged KV cache for a flattened varlen batch."""

from dataclasses import dataclass

import torch

from contbatch import ops
from contbatch.layers import dense_prefill, flash_attention


KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's (key_cache, value_cache), each [num_blocks, num_kv_heads, block_size, head_dim]."""


@dataclass
class AttentionMetadata:
    """Where a step's tokens live in the paged cache (layout: docs/design/kv_cache_layout.md).

    Passed explicitly through the model's forward: no global context.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int = 0  # longest query of the step (flash-attn needs it on the host)
    max_seq_len: int = 0  # longest context of the step


class PagedAttention(torch.nn.Module):
    """Writes this step's K/V into the cache, then attends over each sequence's whole context."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int = -1, scale: float | None = None
    ) -> None:
        """``scale`` multiplies q.k; None: head_dim**-0.5."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``scale`` overrides head_dim**-0.5 for models that set their own (transformers path)."""
        scale = self.scale if scale is None else scale
        key_cache, value_cache = kv_cache
        ops.reshape_and_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        if flash_attention.usable(q, key_cache):
            return flash_attention.paged_attention(
                q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                metadata.max_query_len, metadata.max_seq_len, scale, self.sliding_window,
            )
        out = torch.empty_like(q)
        run = dense_prefill.attend if dense_prefill.has_long_queries(q, metadata.max_query_len) else ops.paged_attention
        run(
            out,
            q,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            self.sliding_window,
        )
        return out
