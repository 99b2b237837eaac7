"""Long prefill chunks on the CPU as dense attention through PyTorch's fused sdpa kernel.

The paged CPU kernel takes at most 16 query rows per pass over a sequence's K/V: right for
decodes and short chunks. A chunk of hundreds of query rows is a matrix-matrix product,
which sdpa computes as blocked GEMMs (about 25% faster at 4,096 rows on 2 cores; see "Long
prompts" in docs/performance.md). Such a sequence's K/V is first gathered from its blocks
into contiguous tensors: a few MB per layer, small beside the attention over it. The other
sequences of the step (decodes, short chunks) still go to the paged kernel together.
"""

import itertools

import torch
import torch.nn.functional as F

from contbatch import ops

# Query rows from which a sequence's chunk goes to sdpa: below this the paged kernel is as
# fast (measured at 500-1,000 rows) and needs no gather.
MIN_QUERY_ROWS = 512


def has_long_queries(q: torch.Tensor, max_query_len: int) -> bool:
    return q.device.type == "cpu" and max_query_len >= MIN_QUERY_ROWS


def attend(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> None:
    """ops.paged_attention's contract (written into ``out``), long chunks computed by sdpa."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    short = []
    for seq, seq_len in enumerate(lens):
        begin, end = starts[seq], starts[seq + 1]
        if end - begin >= MIN_QUERY_ROWS:
            out[begin:end] = _dense(q[begin:end], key_cache, value_cache, block_tables[seq], seq_len, scale, sliding_window)
        elif end > begin:
            short.append(seq)
    if short:
        _paged(out, q, key_cache, value_cache, block_tables, seq_lens, starts, short, scale, sliding_window)


def _dense(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """One sequence's chunk: its queries are its last ``len(q)`` positions."""
    q_len, block_size = q.shape[0], key_cache.shape[2]
    first_query = seq_len - q_len
    # A window hides the keys before the first query's window: gather from the block holding
    # the first visible key.
    first_key = 0 if sliding_window <= 0 else max(0, first_query - sliding_window + 1)
    first_block = first_key // block_size
    blocks = block_table[first_block : (seq_len + block_size - 1) // block_size].long()
    skip = first_key - first_block * block_size
    keys, values = (_gathered(cache, blocks, skip, seq_len - first_key, q.dtype) for cache in (key_cache, value_cache))
    query = q.transpose(0, 1)[None]  # [1, heads, q_len, head_size]
    if first_query == 0 and (sliding_window <= 0 or sliding_window >= seq_len):
        attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = _mask(first_query, seq_len, first_key, sliding_window, q.device)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return attn[0].transpose(0, 1)


def _gathered(cache: torch.Tensor, blocks: torch.Tensor, skip: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, kv_heads, length, head_size] in ``dtype``: the tokens of ``blocks`` from slot ``skip``
    on, in order (dequantized from an int8 cache)."""
    kv_heads, row = cache.shape[1], cache.shape[3]
    tokens = cache.index_select(0, blocks).transpose(0, 1).reshape(kv_heads, -1, row)
    return ops.reference.cache_values(tokens[None, :, skip : skip + length]).to(dtype)


def _mask(first_query: int, seq_len: int, first_key: int, sliding_window: int, device: torch.device) -> torch.Tensor:
    """Bool [q_len, seq_len - first_key]: True where the query position may see the key."""
    q_pos = torch.arange(first_query, seq_len, device=device)[:, None]
    k_pos = torch.arange(first_key, seq_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window > 0:
        visible &= k_pos > q_pos - sliding_window
    return visible


def _paged(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    starts: list[int],
    seqs: list[int],
    scale: float,
    sliding_window: int,
) -> None:
    """The paged kernel on the sub-batch of ``seqs``, its rows gathered and scattered back."""
    rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs]).to(q.device)
    sub_starts = [0, *itertools.accumulate(starts[s + 1] - starts[s] for s in seqs)]
    index = torch.tensor(seqs, device=q.device)
    sub_q = q.index_select(0, rows)
    sub_out = torch.empty_like(sub_q)
    ops.paged_attention(
        sub_out, sub_q, key_cache, value_cache, block_tables.index_select(0, index), seq_lens.index_select(0, index),
        torch.tensor(sub_starts, dtype=torch.int32, device=q.device), scale, sliding_window,
    )  # fmt: skip
    out.index_copy_(0, rows, sub_out)
