"""Pure-PyTorch reference of every cache/attention op.

These define the semantics the compiled kernels in ``csrc/`` must match, and
serve as the fallback when the extension is not built. The cache and varlen batch
layouts (shapes, slots, block tables, which keys a query attends) are written down
once, in docs/design/kv_cache_layout.md.
"""

import torch
import torch.nn.functional as F

from contbatch.ops import int8_blocks
from contbatch.ops.panel_layout import unpack_panels


KV_INT8_SCALE_BYTES = 4
"""An int8 cache row: head_size int8 values, then these bytes holding the row's fp32 scale."""


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of K or V [..., head_size] as int8 cache rows [..., head_size + 4]: per row (one
    token of one kv head), scale = max|x| / 127 and values round-half-even(x * 127 / max|x|),
    computed in fp32; the scale's bytes follow the values. A zero row has scale 0."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # Divisions of two tensors: PyTorch computes `127.0 / t` as 127 * (1 / t), rounded twice.
    qmax = torch.full_like(amax, 127.0)
    inverse = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    values = torch.round(x * inverse).clamp(-127, 127).to(torch.int8)
    scale = (amax / qmax).contiguous()
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows [..., head_size + 4] as fp32 [..., head_size]: values times scale."""
    scale = rows[..., -KV_INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return rows[..., :-KV_INT8_SCALE_BYTES].float() * scale


def cache_rows(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """K or V rows [..., head_size] as ``cache`` stores them: quantized for an int8 cache,
    else converted to its dtype."""
    return quantize_kv_rows(x) if cache.dtype == torch.int8 else x.to(cache.dtype)


def cache_values(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as values [..., head_size]: dequantized (fp32) from an int8 cache, else as stored."""
    return dequantize_kv_rows(rows) if rows.dtype == torch.int8 else rows


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_size] into their cache slots
    (quantized into an int8 cache, ``quantize_kv_rows``).

    Tokens whose slot is negative are skipped (padding or already cached)."""
    block_size = key_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    # Advanced indexing on dims 0 and 2 puts the token dim first: [T, kv_heads, head].
    key_cache[blocks, :, offsets] = cache_rows(key, key_cache)
    value_cache[blocks, :, offsets] = cache_rows(value, value_cache)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
) -> None:
    """Causal attention of a varlen batch over the paged cache, written into ``out``.

    Accumulates in fp32 (over the dequantized values of an int8 cache); ``out`` has the
    query's dtype and shape."""
    block_size = key_cache.shape[2]
    q_starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for seq, seq_len in enumerate(lens):
        q_begin, q_end = q_starts[seq], q_starts[seq + 1]
        if q_end == q_begin:
            continue
        # Keys before the first query's window are never read: their blocks may be freed.
        first_key = 0 if sliding_window <= 0 else max(0, seq_len - (q_end - q_begin) - sliding_window + 1)
        first_block = first_key // block_size
        blocks = block_tables[seq, first_block : (seq_len + block_size - 1) // block_size].long()
        skip = first_block * block_size
        keys = _gather_sequence(key_cache, blocks, seq_len - skip)
        values = _gather_sequence(value_cache, blocks, seq_len - skip)
        q = query[q_begin:q_end].transpose(0, 1).float()  # [heads, q_len, head]
        mask = _causal_mask(q_end - q_begin, seq_len, sliding_window, q.device)[:, skip:]
        attn = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[q_begin:q_end] = attn.transpose(0, 1).to(out.dtype)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks ``src -> dst`` (block_mapping: [n, 2] int64) in every layer."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]


def _gather_sequence(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_kv_heads, seq_len, head_size] in fp32 from the sequence's blocks."""
    gathered = cache[blocks]  # [n_blocks, kv_heads, block_size, row]
    kv_heads, row = cache.shape[1], cache.shape[3]
    gathered = gathered.transpose(0, 1).reshape(kv_heads, -1, row)
    return cache_values(gathered[:, :seq_len]).float()


def _causal_mask(q_len: int, seq_len: int, sliding_window: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    return mask


# --- Fused layer ops ------------------------------------------------------------------
# Each is the plain PyTorch formula, evaluated op by op in the input dtype the way HF
# transformers does (fp32 inside RMSNorm); the CPU kernels round where these do.


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out = weight * (x / sqrt(mean(x^2) + eps)), the norm in fp32 and cast back before the weight."""
    x32 = x.float()
    out.copy_(weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x (the residual stream), then x = rms_norm(residual)."""
    residual.add_(x)
    rms_norm(x, residual, weight, eps)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out = silu(gate) * up for x = [gate | up] along the last dim."""
    gate, up = x.chunk(2, dim=-1)
    torch.mul(F.silu(gate), up, out=out)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate-half rotary embedding, in place. query [tokens, heads, head_size], key
    [tokens, kv_heads, head_size]; cos/sin [max_positions, head_size] indexed by position."""
    cos_t, sin_t = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for x in (query, key):
        x.copy_(x * cos_t + _rotate_half(x) * sin_t)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def argmax_rows(out: torch.Tensor, logits: torch.Tensor) -> None:
    """out[r] = index of the first maximum of logits[r], NaN counting as the largest."""
    # max().indices, not argmax(): the same answer, and 4x faster on bf16 in PyTorch's CPU kernels.
    torch.max(logits, dim=-1, out=(torch.empty_like(out, dtype=logits.dtype), out))


def sample_rows(
    out: torch.Tensor,
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> None:
    """out[r] = a token drawn from logits[r] (fp32 logits are modified in place), -1 where every
    token is masked out (-inf) or the row's maximum is +inf.

    Temperature 0: the argmax. Otherwise weights e^((logit - row max) / temperature), min-p
    (keeps the weights >= min_p; the largest is 1), then top-k (0: off) and top-p (1: off):
    the k largest weights, then the smallest prefix of them, largest first, whose mass reaches
    top_p of theirs (of the row's, without top-k); of equal weights at the cut, the native
    kernel keeps the lower token ids, this reference those torch.topk lists first. The token
    is where uniform[r] (float64 in [0, 1)) of the remaining mass falls, in token-id order."""
    greedy = temperatures == 0
    argmax_rows(out, logits)
    greedy_without_token = greedy & logits.gather(1, out.unsqueeze(1)).flatten().isneginf()
    if bool(greedy.all()):
        out.masked_fill_(greedy_without_token, -1)
        return
    weights = logits.float()
    row_max = weights.amax(dim=-1, keepdim=True)
    no_number = (~(row_max > float("-inf")) | (row_max == float("inf"))).flatten()
    weights = _tempered_weights(weights, row_max, torch.where(greedy, 1.0, temperatures))
    # vLLM's order: min-p on the tempered distribution, then top-k and top-p on what it kept.
    _apply_min_p(weights, min_p)
    sampled = torch.empty_like(out)
    narrowed = ((top_k > 0) & (top_k < logits.shape[-1])) | (top_p < 1)  # top_k >= vocab: no top-k
    top_rows, whole_rows = narrowed.nonzero().flatten(), (~narrowed).nonzero().flatten()
    if top_rows.numel():
        sampled[top_rows] = _draw_top(_take_rows(weights, top_rows), uniform[top_rows], top_k[top_rows], top_p[top_rows])
    if whole_rows.numel():
        sampled[whole_rows] = _draw(_take_rows(weights, whole_rows), uniform[whole_rows])
    sampled_without_token = no_number | ~(weights.gather(1, sampled.unsqueeze(1)).flatten() > 0)
    out.copy_(torch.where(greedy, out, sampled))
    out.masked_fill_(torch.where(greedy, greedy_without_token, sampled_without_token), -1)


def _tempered_weights(logits: torch.Tensor, row_max: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """exp((logits - row max) / temperature) in place on fp32 logits, 0 for NaN: the
    unnormalised probabilities, 1 at each row's most likely token (no softmax: one pass less)."""
    return logits.sub_(row_max).div_(temperatures.unsqueeze(1)).exp_().nan_to_num_(nan=0.0)


def _apply_min_p(weights: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero the weights below min_p (the largest weight of a row is 1), a row at a time in
    place: a [rows, vocab] mask would cost a pass and an allocation more."""
    below = torch.nextafter(min_p, torch.tensor(-1.0, device=min_p.device))  # threshold_ keeps weight > below
    for row, (value, threshold) in enumerate(zip(min_p.tolist(), below.tolist())):
        if value > 0:
            torch.nn.functional.threshold_(weights[row], threshold, 0.0)


def _take_rows(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weights[rows], without the copy when rows are all of them in order (one SamplingParams for all)."""
    return weights if rows.numel() == weights.shape[0] else weights[rows]


TOP_CANDIDATES = 64


def _draw_top(weights: torch.Tensor, uniform: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows with top-k or top-p: drawn among each row's largest weights (a partial selection,
    not a sort of the vocabulary): the k most likely, then the smallest prefix of those whose
    mass reaches top_p of theirs. A top-p prefix not found among the first candidates is
    looked for among 8 times as many."""
    vocab = weights.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    tokens = torch.empty(weights.shape[0], dtype=torch.int64, device=weights.device)
    pending = torch.arange(weights.shape[0], device=weights.device)
    candidates = max(TOP_CANDIDATES, int(k[k < vocab].max()) if bool((k < vocab).any()) else 0)
    while pending.numel():
        candidates = min(candidates, vocab)
        rows = _take_rows(weights, pending)
        values, token_ids = rows.topk(candidates, dim=-1)  # descending
        row_k, row_p = k[pending].unsqueeze(1), top_p[pending].unsqueeze(1)
        ranks = torch.arange(candidates, device=weights.device)
        values = values.masked_fill_(ranks >= row_k, 0.0)
        mass = torch.where(row_k <= candidates, values.sum(dim=-1, keepdim=True), rows.sum(dim=-1, keepdim=True))
        reached = values.cumsum(dim=-1) >= row_p * mass
        any_reached = reached.any(dim=-1, keepdim=True)
        # Every token a candidate and top_p not reached (rounding): all of them stay.
        first_reached = torch.where(any_reached, reached.int().argmax(dim=-1, keepdim=True), candidates - 1)
        last = torch.where(row_p >= 1, row_k - 1, first_reached)
        found = ((row_p >= 1) | any_reached | (candidates == vocab)).flatten()
        values = values.masked_fill_(ranks > last, 0.0)
        # Drawn in token-id order among the kept: the order does not change the distribution.
        by_id = token_ids[found].argsort(dim=-1)
        picked = _inverse_cdf(values[found].gather(1, by_id), uniform[pending[found]])
        tokens[pending[found]] = token_ids[found].gather(1, by_id.gather(1, picked.unsqueeze(1))).flatten()
        pending, candidates = pending[~found], candidates * 8
    return tokens


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows] column of each row with probability weight / row sum, for a uniform per row: the
    first column whose cumulative weight passes uniform x the total, in float64 so that the
    target never reaches the total. Rounding can leave it past the last column of weight:
    then that column."""
    cdf = weights.double().cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)
    columns = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, columns, 0).amax(dim=-1, keepdim=True)
    return torch.where(weights.gather(1, picked) > 0, picked, last_positive).flatten()


DRAW_BLOCK = 256


def _draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row with probability weight / row sum: the inverse CDF in two levels, sums
    of blocks of DRAW_BLOCK tokens (one pass over the vocabulary), then the chosen block."""
    rows, vocab = weights.shape
    whole = vocab // DRAW_BLOCK * DRAW_BLOCK
    block_sums = weights[:, :whole].reshape(rows, -1, DRAW_BLOCK).sum(dim=-1)
    if whole < vocab:
        block_sums = torch.cat([block_sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    block = _inverse_cdf(block_sums, uniform).unsqueeze(1)
    block_cdf = block_sums.double().cumsum(dim=-1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    within = ((uniform.unsqueeze(1) * block_cdf[:, -1:] - before) / block_sums.gather(1, block).double()).flatten()
    columns = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=weights.device)
    in_block = torch.where(columns < vocab, weights.gather(1, columns.clamp(max=vocab - 1)), 0.0)
    return (block.flatten() * DRAW_BLOCK + _inverse_cdf(in_block, within.clamp(0.0, 1.0 - 2**-53))).clamp_(max=vocab - 1)


def bf16_linear(out: torch.Tensor, x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = x @ weight.T (+ bias) for a weight in the panel layout (ops/panel_layout.py):
    fp32 sums, rounded to out's dtype once, after the bias."""
    weight = unpack_panels(packed_weight, out.shape[1], x.shape[1])
    result = x.float() @ weight.float().T
    if bias is not None:
        result += bias.float()
    out.copy_(result)


def int8_quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 [rows, padded_in], scales fp32 [rows, blocks]) of ``x``: per-token
    quantization in blocks of ``block`` inputs, 32 or 64 (contbatch/ops/int8_blocks.py)."""
    blocks = int8_blocks.quantize_activations(x, block)
    return blocks.values, blocks.scales


def int8_linear(
    out: torch.Tensor,
    x_values: torch.Tensor,
    x_scales: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    weight_offset: int = int8_blocks.WEIGHT_OFFSET,
) -> None:
    """out = x @ weight.T (+ bias) from quantized activations and a packed int8 weight (the
    activations in the weight's blocks), its values stored as q + weight_offset."""
    rows, out_features = out.shape
    padded = x_values.shape[1]
    packed = int8_blocks.PackedInt8(values, scales, out_features, padded, weight_offset)
    weight = int8_blocks.unpack_int8(packed)
    x = int8_blocks.Int8Blocks(x_values, x_scales, padded)
    out.copy_(int8_blocks.int8_linear_reference(x, weight, bias))


def int8_quantize_linear(
    out: torch.Tensor,
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    weight_offset: int = int8_blocks.WEIGHT_OFFSET,
) -> None:
    """int8_quantize_rows in the weight's blocks, then int8_linear, in one call."""
    x_values, x_scales = int8_quantize_rows(x, int8_blocks.packed_block(values))
    int8_linear(out, x_values, x_scales, values, scales, bias, weight_offset)
