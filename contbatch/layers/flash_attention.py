"""GPU attention through flash-attn's paged varlen kernel, when flash-attn is installed.

flash-attn (the optional ``gpu`` extra) reads a paged cache laid out
[num_blocks, block_size, kv_heads, head_size] with pages of a multiple of 256 tokens. Our
cache is [num_blocks, kv_heads, block_size, head_size] (docs/design/kv_cache_layout.md), so the
same memory is handed over as a permuted view: flash-attn takes every stride but the last
from the tensor. The engine picks 256-token blocks on CUDA when flash-attn is importable,
and the extension's own CUDA kernel runs otherwise.

No GPU exists where contbatch is developed: this path is checked against the reference
through a stand-in that implements flash-attn's documented contract on the CPU
(tests/ops/test_flash_attention.py), never with flash-attn itself.
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

FLASH_PAGE_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def flash_attn_varlen() -> Callable | None:
    """flash_attn.flash_attn_varlen_func, or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def available() -> bool:
    return flash_attn_varlen() is not None


def usable(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """flash-attn can serve this call: CUDA, fp16/bf16, pages of a multiple of 256 tokens."""
    return (
        query.is_cuda
        and query.dtype in FLASH_DTYPES
        and key_cache.shape[2] % FLASH_PAGE_MULTIPLE == 0
        and available()
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """Same semantics as contbatch.ops.paged_attention (causal, GQA, optional window); returns out."""
    cu_seqlens_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    # Query i of a sequence sits at key position seq_len - q_len + i (bottom-right causal
    # alignment, flash-attn's convention) and sees sliding_window keys ending there.
    window = (sliding_window - 1, 0) if sliding_window > 0 else (-1, -1)
    return flash_attn_varlen()(
        query,
        key_cache.permute(0, 2, 1, 3),
        value_cache.permute(0, 2, 1, 3),
        query_start_loc,
        cu_seqlens_k,
        max_query_len,
        max_seq_len,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        block_table=block_tables,
    )
