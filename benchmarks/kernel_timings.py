"""Times the compiled cache/attention ops (contbatch._C) against the PyTorch reference.

Decode paged_attention at SmolLM2-135M's shapes (9 query heads, 3 kv heads, head_size 64,
block_size 16, physical blocks shuffled over the whole cache), for batch 1, 32 and 256 and
contexts 128 to 4096, in bf16 and fp32; at context 512 with each sequence's blocks in order
(as the block manager allocates them while the pool has room); and at batch 256, context
1024 with larger blocks.
Achieved bandwidth counts the K/V bytes read, set against a large tensor copy measured in
the same run (read + write bytes). Small batches rotate over copies on disjoint blocks, at
least 256 MiB in all, so that K/V come from DRAM as in a real model with many layers, not
from the CPU caches. Also one prefill batch, reshape_and_cache, and the sampler's
argmax_rows and sample_rows over SmolLM2's 49,152-token vocabulary. Prints a markdown table; --out FILE
writes it to FILE too.

    python benchmarks/kernel_timings.py [--out FILE] [--quick] [--update-docs]
    python benchmarks/kernel_timings.py --sampler                          # the sampler's ops only
    python benchmarks/kernel_timings.py --kv-cache-dtype int8 [--quick]   # int8 caches (kv_cache_dtype="int8")

With --kv-cache-dtype int8 the caches hold the same values in int8 rows (values and a
scale, docs/design/kv_cache_layout.md), the queries stay bf16 or fp32, and the sampler rows
are left out (they do not read the cache).
"""

import argparse
import time
from collections.abc import Callable

import torch

from contbatch.ops import reference

from _report import replace_marked
from _machine import cpu_description, cpu_kind
from _roofline import copy_bandwidth

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
# Block sizes for the batch 256, context 1024 decode rows: a block holds
# block_size x 128 x 3 contiguous bytes of K (and of V) in bf16 (all kv heads, which one
# work item reads together), and longer runs stream better.
LARGER_BLOCK_SIZES = (64, 256)
SCALE = HEAD_SIZE**-0.5
VOCAB_SIZE = 49152
BATCHES = (1, 32, 256)
CONTEXTS = (128, 512, 1024, 4096)
REFERENCE_MAX_TOKENS = 256 * 1024  # the reference takes seconds per call beyond this many context tokens
ROTATION_BYTES = 256 * 2**20  # K/V touched between two calls on the same blocks


def time_call(fn: Callable[[], None], min_seconds: float = 0.5, max_iters: int = 50) -> float:
    """Fastest seconds per call after one warm-up call: other processes on a shared machine
    only ever add time (the slowest calls can wait a whole scheduler slice for a thread)."""
    fn()
    times: list[float] = []
    while len(times) < max_iters and (len(times) < 3 or sum(times) < min_seconds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class Cache:
    """One key and value cache for the largest batch x context, shared by all configs."""

    def __init__(self, dtype: torch.dtype, max_tokens: int, block_size: int = BLOCK_SIZE, int8: bool = False) -> None:
        """``dtype``: the queries' (and, unless ``int8``, the caches')."""
        self.block_size = block_size
        self.num_blocks = max_tokens // block_size
        self.query_dtype = dtype
        self.label = str(dtype).removeprefix("torch.") + (", int8 KV" if int8 else "")
        shape = (self.num_blocks, NUM_KV_HEADS, block_size, HEAD_SIZE)

        def values() -> torch.Tensor:
            uniform = torch.empty(shape).uniform_(-1, 1)
            return reference.quantize_kv_rows(uniform) if int8 else uniform.to(dtype)

        self.key, self.value = values(), values()

    def batches(self, seq_lens: list[int], query_lens: list[int], copies: int, in_order: bool = False) -> list[tuple]:
        """paged_attention's arguments after `out` for `copies` batches on disjoint blocks: shuffled,
        or with in_order each sequence's blocks consecutive, as the block manager hands them out
        while the pool has room (contbatch/engine/block_manager.py)."""
        blocks = [-(-n // self.block_size) for n in seq_lens]
        order = torch.arange(self.num_blocks) if in_order else torch.randperm(self.num_blocks)
        physical = order[: copies * sum(blocks)].int()
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        query = torch.empty(int(starts[-1]), NUM_HEADS, HEAD_SIZE, dtype=self.query_dtype).uniform_(-1, 1)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        result, start = [], 0
        for _ in range(copies):
            tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
            for seq, count in enumerate(blocks):
                tables[seq, :count] = physical[start : start + count]
                start += count
            result.append((query, self.key, self.value, tables, seq_lens_t, starts))
        return result


def attention_row(
    cache: Cache, name: str, seq_lens: list[int], query_lens: list[int], copy_gbs: float, in_order: bool = False
) -> dict:
    kv_bytes = sum(seq_lens) * NUM_KV_HEADS * cache.key.shape[-1] * 2 * cache.key.element_size()
    blocks = sum(-(-n // cache.block_size) for n in seq_lens)
    copies = min(-(-ROTATION_BYTES // kv_bytes), cache.num_blocks // blocks)
    batches = cache.batches(seq_lens, query_lens, copies, in_order)
    out = torch.empty_like(batches[0][0])
    calls = iter(range(10**9))

    def compiled_call() -> None:
        torch.ops.contbatch.paged_attention(out, *batches[next(calls) % copies], SCALE)

    compiled = time_call(compiled_call)
    row = dict(op=name, dtype=cache.label, compiled_ms=compiled * 1e3)
    if all(q == 1 for q in query_lens):  # decode reads each K/V row once; prefill is compute-bound
        row["gbs"] = kv_bytes / compiled / 1e9
        row["pct_copy"] = 100 * row["gbs"] / copy_gbs
    if sum(seq_lens) <= REFERENCE_MAX_TOKENS:
        ref = time_call(lambda: reference.paged_attention(out, *batches[0], SCALE), min_seconds=0.2, max_iters=5)
        row["reference_ms"] = ref * 1e3
        row["speedup"] = ref / compiled
    return row


def reshape_and_cache_row(cache: Cache, num_tokens: int) -> dict:
    key = torch.empty(num_tokens, NUM_KV_HEADS, HEAD_SIZE, dtype=cache.query_dtype).uniform_(-1, 1)
    value = torch.empty_like(key).uniform_(-1, 1)
    slots = torch.randperm(cache.num_blocks * cache.block_size)[:num_tokens]
    compiled = time_call(lambda: torch.ops.contbatch.reshape_and_cache(key, value, cache.key, cache.value, slots))
    ref = time_call(lambda: reference.reshape_and_cache(key, value, cache.key, cache.value, slots), max_iters=20)
    return dict(op=f"reshape_and_cache {num_tokens} tokens", dtype=cache.label,
                compiled_ms=compiled * 1e3, reference_ms=ref * 1e3, speedup=ref / compiled)


def argmax_rows_row(dtype: torch.dtype, rows: int) -> dict:
    logits = torch.randn(rows, VOCAB_SIZE).to(dtype)
    out = torch.empty(rows, dtype=torch.int64)
    compiled = time_call(lambda: torch.ops.contbatch.argmax_rows(out, logits), min_seconds=0.2)
    ref = time_call(lambda: reference.argmax_rows(out, logits), min_seconds=0.2)
    return dict(op=f"argmax_rows {rows} x {VOCAB_SIZE}", dtype=str(dtype).removeprefix("torch."),
                compiled_ms=compiled * 1e3, reference_ms=ref * 1e3, speedup=ref / compiled)


SAMPLER_SETTINGS = {  # (temperature, top_k, top_p)
    "temperature 0.8": (0.8, 0, 1.0),
    "top_k 40, top_p 0.95": (0.8, 40, 0.95),
    "top_p 0.9": (0.8, 0, 0.9),  # random logits: a nucleus of thousands of tokens, the selection by mass
}


def sample_rows_row(dtype: torch.dtype, rows: int, setting: str) -> dict:
    """The sampler's draw over logits with a spread like a model's (standard deviation 3)."""
    temperature, top_k, top_p = SAMPLER_SETTINGS[setting]
    logits = (torch.randn(rows, VOCAB_SIZE) * 3).to(dtype)
    out = torch.empty(rows, dtype=torch.int64)
    args = (torch.full((rows,), temperature), torch.full((rows,), top_k, dtype=torch.int64),
            torch.full((rows,), top_p), torch.zeros(rows), torch.rand(rows, dtype=torch.float64))
    compiled = time_call(lambda: torch.ops.contbatch.sample_rows(out, logits, *args), min_seconds=0.2)
    ref = time_call(lambda: reference.sample_rows(out, logits.clone(), *args), min_seconds=0.2, max_iters=5)
    return dict(op=f"sample_rows {rows} x {VOCAB_SIZE}, {setting}", dtype=str(dtype).removeprefix("torch."),
                compiled_ms=compiled * 1e3, reference_ms=ref * 1e3, speedup=ref / compiled)


def sampler_rows(dtype: torch.dtype) -> list[dict]:
    rows = [argmax_rows_row(dtype, num_rows) for num_rows in (1, 256)]
    return rows + [sample_rows_row(dtype, 256, setting) for setting in SAMPLER_SETTINGS]


def markdown(rows: list[dict], copy_gbs: float) -> str:
    lines = [
        f"Copy bandwidth (512 MiB tensor copy, read + write): {copy_gbs:.1f} GB/s. "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Times: fastest of at least 3 calls.",
        "",
        "| op | dtype | compiled ms | K/V GB/s | % of copy bw | reference ms | speedup |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        cells = [
            r["op"],
            r["dtype"],
            f"{r['compiled_ms']:.3f}",
            f"{r['gbs']:.1f}" if "gbs" in r else "",
            f"{r['pct_copy']:.0f}%" if "pct_copy" in r else "",
            f"{r['reference_ms']:.2f}" if "reference_ms" in r else "skipped",
            f"{r['speedup']:.1f}x" if "speedup" in r else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Reference skipped above {REFERENCE_MAX_TOKENS} context tokens per call (seconds per call)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--quick", action="store_true", help="bf16 only, contexts up to 1024")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                        help="the caches in the query dtype, or in int8 rows")
    parser.add_argument("--sampler", action="store_true", help="only the sampler's ops (argmax_rows, sample_rows)")
    parser.add_argument("--update-docs", action="store_true",
                        help="rewrite this kind of CPU's kernels section of docs/performance.md")
    args = parser.parse_args()
    from contbatch import _C  # noqa: F401  (fails loudly when the extension is not built)

    if args.sampler:
        rows = [row for dtype in (torch.bfloat16, torch.float32) for row in sampler_rows(dtype)]
        print(f"CPU: {cpu_description()}.\n")
        print(markdown(rows, copy_bandwidth()))
        return
    copy_gbs = copy_bandwidth()
    int8 = args.kv_cache_dtype == "int8"
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float32)
    contexts = tuple(c for c in CONTEXTS if not args.quick or c <= 1024)
    rows = []
    for dtype in dtypes:
        cache = Cache(dtype, max(BATCHES) * max(contexts), int8=int8)
        for batch in BATCHES:
            for context in contexts:
                name = f"decode batch {batch} ctx {context}"
                rows.append(attention_row(cache, name, [context] * batch, [1] * batch, copy_gbs))
                print(rows[-1], flush=True)
        for batch in BATCHES:
            name = f"decode batch {batch} ctx 512, blocks in order"
            rows.append(attention_row(cache, name, [512] * batch, [1] * batch, copy_gbs, in_order=True))
            print(rows[-1], flush=True)
        rows.append(attention_row(cache, "prefill 8 x 200 tokens", [200] * 8, [200] * 8, copy_gbs))
        for num_tokens in (32, 256, 4096):
            rows.append(reshape_and_cache_row(cache, num_tokens))
        if not int8:
            rows += sampler_rows(dtype)
        del cache
        for block_size in LARGER_BLOCK_SIZES:
            cache = Cache(dtype, 256 * 1024, block_size, int8=int8)
            name = f"decode batch 256 ctx 1024, block {block_size}"
            rows.append(attention_row(cache, name, [1024] * 256, [1] * 256, copy_gbs))
            print(rows[-1], flush=True)
            del cache
    table = markdown(rows, copy_gbs)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.update_docs:
        command = "python benchmarks/kernel_timings.py --update-docs" + (" --quick" if args.quick else "") + \
            (" --kv-cache-dtype int8" if int8 else "")
        measured = f"Measured {time.strftime('%Y-%m-%d %H:%M:%S')} with `{command}`. CPU: {cpu_description()}."
        replace_marked(f"kernels-{'int8-kv-' if int8 else ''}{cpu_kind()}", f"{measured}\n\n{table}")


if __name__ == "__main__":
    main()
