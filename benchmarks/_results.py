"""What every system's run reports, built the same way for all of them."""

import resource

import numpy as np


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarize(
    requests: list,
    wall_s: float,
    ttfts: list[float],
    generated: list[int],
    load_s: float,
    peak_rss: float,
) -> dict:
    """Throughput and latency of one timed run over ``requests`` (BenchRequests).

    Tokens are counted as asked for (prompt + max_tokens), never tokens a system
    generated past a request's max_tokens; ``generated`` (per request, capped at its
    max_tokens) is kept so a short-changed request shows up as output_tokens_missing.
    """
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)
    return {
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_missing": output_tokens - sum(min(g, r.max_tokens) for g, r in zip(generated, requests)),
        "load_s": load_s,
        "wall_s": wall_s,
        "output_tok_s": output_tokens / wall_s,
        "total_tok_s": (prompt_tokens + output_tokens) / wall_s,
        "ttft_median_s": float(np.median(ttfts)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "peak_rss_mib": peak_rss,
        "requests": [
            [len(r.prompt_token_ids), r.max_tokens, g, t] for r, g, t in zip(requests, generated, ttfts)
        ],
    }
