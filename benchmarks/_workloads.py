"""Benchmark workloads: chat256 from disk, and synthetic workloads of the same shape.

Every system gets the same prompt token ids (tokenised here once), so tokenisation is
never part of a timed run and no system can tokenise differently.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAT256_PATH = REPO_ROOT / "benchmarks" / "workloads" / "chat256.jsonl"
WORKLOADS = ("chat256", "synthetic1024", "synthetic4096")
SYNTHETIC_SEED = 1234

_SYSTEM_TEMPLATE = "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n"
_ASSISTANT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def load_workload(name: str, tokenizer, limit: int | None = None, max_tokens_cap: int | None = None) -> list[BenchRequest]:
    """The named workload's requests, the first ``limit`` only, max_tokens capped at ``max_tokens_cap``."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    rows = _read_chat256()
    if name == "chat256":
        requests = [BenchRequest(tokenizer(row["prompt"]).input_ids, row["max_tokens"]) for row in rows]
    else:
        requests = _synthetic(rows, int(name.removeprefix("synthetic")), tokenizer)
    if limit is not None:
        requests = requests[:limit]
    if max_tokens_cap is not None:
        requests = [BenchRequest(r.prompt_token_ids, min(r.max_tokens, max_tokens_cap)) for r in requests]
    return requests


def _read_chat256() -> list[dict]:
    if not CHAT256_PATH.exists():
        raise FileNotFoundError(f"chat256 workload not found at {CHAT256_PATH}")
    with open(CHAT256_PATH) as f:
        return [json.loads(line) for line in f if line.strip()]


def _synthetic(rows: list[dict], num_requests: int, tokenizer) -> list[BenchRequest]:
    """Resample chat256 rows (prompt length and max_tokens together) with a fixed seed.

    Each synthetic prompt keeps its row's system prompt and chat template, so prefix
    sharing is like chat256's, and replaces the user's words with random ordinary
    tokens of the same count.
    """
    rng = random.Random(SYNTHETIC_SEED)
    ordinary = _ordinary_ids(tokenizer)
    suffix = tokenizer(_ASSISTANT_SUFFIX).input_ids
    requests = []
    for _ in range(num_requests):
        row = rng.choice(rows)
        prefix = tokenizer(_SYSTEM_TEMPLATE.format(row["messages"][0]["content"])).input_ids
        num_user = max(1, len(tokenizer(row["prompt"]).input_ids) - len(prefix) - len(suffix))
        user = [rng.choice(ordinary) for _ in range(num_user)]
        requests.append(BenchRequest(prefix + user + suffix, row["max_tokens"]))
    return requests


def random_requests(tokenizer, count: int, prompt_len: int, max_tokens: int, seed: int = 0) -> list[BenchRequest]:
    """Prompts of random ordinary tokens (sharing no prefix with any workload), for warm-up and probes."""
    rng = random.Random(seed)
    ordinary = _ordinary_ids(tokenizer)
    return [BenchRequest([rng.choice(ordinary) for _ in range(prompt_len)], max_tokens) for _ in range(count)]


def _ordinary_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]
