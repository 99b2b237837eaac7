"""Long prefill chunks on the CPU as dense attention through PyTorch's fused sdpa kernel,
on the kernel tiers where that is faster than the paged kernel.

The paged CPU kernel takes at most 16 query rows per pass over a sequence's K/V: right for
decodes and short chunks. A chunk of hundreds of query rows is a matrix-matrix product,
which sdpa computes as blocked GEMMs. Which is faster depends on the tier (one 5,000-token
prefill of SmolLM2 on Zen 5, 2026-11-26; "Long prompts" in docs/performance.md):
- avx512_bf16 and avx512: the paged kernel, 1.3x (fp32) to 1.7x (bf16) faster than sdpa,
  whose CPU kernel runs bf16 no faster than fp32;
- avx2: the same speed in either dtype (within 3% from 1,000 to 8,191 tokens), so sdpa stays;
- generic: sdpa, 5x.
On the tiers that take sdpa, a long chunk's K/V is first gathered from its blocks into
contiguous tensors: a few MB per layer, small beside the attention over it. The other
sequences of the step (decodes, short chunks) still go to the paged kernel together.

A chunk after earlier tokens of its sequence (the second chunk of a long prompt, or a prompt
after a cached prefix) sees every earlier key and its own keys causally. sdpa's causal flag
aligns the mask to the first key, not the last, so such a chunk would need a boolean mask, with
which sdpa computes and masks every block of the chunk's rectangle. Instead it runs twice
without one, over the earlier keys and (causal) over its own, and the two are merged by
their log-sum-exps: 1.5x faster at 3,904 queries over 8,000 keys.
"""

import functools
import itertools

import torch
import torch.nn.functional as F

from contbatch import ops

# Query rows from which a sequence's chunk goes to sdpa: below this the paged kernel is as
# fast (measured at 500-1,000 rows) and needs no gather.
MIN_QUERY_ROWS = 512
# Kernel tiers whose paged kernel is faster than sdpa however long the chunk (see above).
PAGED_LONG_CHUNK_TIERS = frozenset({"avx512", "avx512_bf16"})


def has_long_queries(q: torch.Tensor, max_query_len: int) -> bool:
    """Whether the step's long chunks go to sdpa (`attend`) rather than the paged kernel."""
    return q.device.type == "cpu" and max_query_len >= MIN_QUERY_ROWS and ops.cpu_isa() not in PAGED_LONG_CHUNK_TIERS


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
    no_window = sliding_window <= 0 or sliding_window >= seq_len
    if first_query == 0 and no_window:
        attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    elif no_window and (flash := _flash_kernel_with_lse()) is not None:
        attn = _after_earlier_keys(flash, query, keys, values, first_query, scale)
    else:
        mask = _mask(first_query, seq_len, first_key, sliding_window, q.device)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return attn[0].transpose(0, 1)


@functools.cache
def _flash_kernel_with_lse():
    """PyTorch's CPU flash attention, which returns each query row's log-sum-exp beside the
    output (sdpa drops it), or None. It is private to PyTorch, so it is tried once, on tiny
    inputs at the first later chunk (not at import: that first call takes ~14 ms), expecting
    an [B, heads, q_len] log-sum-exp: a build without it, or where it has another signature,
    sends later chunks to the masked path instead of failing a run."""
    kernel = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if kernel is None:
        return None
    try:
        q = torch.zeros(1, 2, 3, 16)
        out, lse = kernel(q, q, q, 0.0, True, scale=0.25)
    except (RuntimeError, TypeError):
        return None
    return kernel if out.shape == q.shape and lse.shape == (1, 2, 3) else None


def _after_earlier_keys(
    flash, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_earlier: int, scale: float
) -> torch.Tensor:
    """[1, heads, q_len, head_size]: queries at the last ``q_len`` positions over ``keys``, the
    first ``num_earlier`` of which every query sees; ``flash``: _flash_kernel_with_lse()'s."""
    _, heads, q_len, head_size = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    # No query row is masked from an earlier key, so the query heads sharing a K/V head (GQA
    # repeats K/V heads in order) are stacked as the rows of one call: K/V read once per group.
    stacked = query.reshape(1, kv_heads, group * q_len, head_size)
    earlier, earlier_lse = flash(stacked, keys[:, :, :num_earlier], values[:, :, :num_earlier], 0.0, False, scale=scale)
    own_keys, own_values = (t[:, :, num_earlier:].repeat_interleave(group, 1) for t in (keys, values))
    own, own_lse = flash(query, own_keys, own_values, 0.0, True, scale=scale)
    return _merged(earlier.reshape(query.shape), earlier_lse.reshape(1, heads, q_len), own, own_lse).to(query.dtype)


def _merged(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over two disjoint key sets from each one's output and log-sum-exp."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    return out_a.float() * (weight_a / total)[..., None] + out_b.float() * (weight_b / total)[..., None]


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
