"""What every system's run reports, built the same way for all of them, and the subprocess that reports it."""

import json
import resource
import subprocess
from pathlib import Path

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


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How far two systems' greedy token ids for the same requests agree.

    requests_identical: share of requests whose token ids are the same; tokens_before_divergence:
    share of the reference's tokens that come before each request's first differing token;
    leading_share_mean: the same share per request, averaged over requests.
    """
    if len(reference) != len(other):
        raise ValueError(f"token ids of {len(reference)} and {len(other)} requests cannot be compared")
    leading = [
        next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        for ours, theirs in zip(reference, other)
    ]
    total = sum(len(ids) for ids in reference)
    return {
        "requests": len(reference),
        "requests_identical": sum(a == b for a, b in zip(reference, other)) / len(reference),
        "tokens_before_divergence": sum(leading) / total if total else 1.0,
        "leading_share_mean": sum(n / len(ids) if ids else 1.0 for n, ids in zip(leading, reference)) / len(reference),
    }


def run_subprocess(command: list[str], env: dict, out: Path, cwd: Path | None = None) -> dict:
    """Run one system's subprocess (in ``cwd``, default this one's): the result JSON it wrote to
    ``out``, or {"error": ...} if it failed."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit code {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(out.read_text())
