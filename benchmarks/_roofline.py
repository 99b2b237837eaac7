"""Compute ceiling: the workload's FLOPs (from config.json) over this machine's measured matmul rate.

FLOPs counted (matmuls only; norms, rotary and softmax are left out):
- each prompt token: 2 x non-embedding parameters (its logits are not computed);
- each generated token: 2 x all parameters, LM head included (a tied LM head counts once more);
- attention: 4 x context x (heads x head_dim) per layer per token (QK^T and PV), context
  being the number of keys the token attends to (its position + 1).
"""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class ModelFlops:
    non_embedding_params: int
    lm_head_params: int
    attention_flops_per_context_token: int  # per token, per key attended to, all layers

    @classmethod
    def from_config(cls, model_dir: Path) -> "ModelFlops":
        config = json.loads((Path(model_dir) / "config.json").read_text())
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        kv_heads = config.get("num_key_value_heads", heads)
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        mlp = 3 * hidden * config["intermediate_size"]
        norms = 2 * hidden
        non_embedding = layers * (attention + mlp + norms) + hidden
        return cls(
            non_embedding_params=non_embedding,
            lm_head_params=config["vocab_size"] * hidden,
            attention_flops_per_context_token=4 * heads * head_dim * layers,
        )

    def weight_bytes(self, element_size: int) -> int:
        """Bytes of weights one decode step reads: every projection plus the LM head (the
        embedding rows a step looks up are negligible)."""
        return (self.non_embedding_params + self.lm_head_params) * element_size

    def step_flops(self, num_tokens: int, num_sampled: int, context_sum: int) -> int:
        """FLOPs of one forward over ``num_tokens`` tokens, ``num_sampled`` of them through the LM head."""
        return (
            2 * self.non_embedding_params * num_tokens
            + 2 * self.lm_head_params * num_sampled
            + self.attention_flops_per_context_token * context_sum
        )

    def workload_flops(self, requests: list) -> int:
        """FLOPs of a whole workload of BenchRequests (every request runs to its max_tokens)."""
        total = 0
        for request in requests:
            prompt, output = len(request.prompt_token_ids), request.max_tokens
            total += 2 * self.non_embedding_params * prompt
            total += 2 * (self.non_embedding_params + self.lm_head_params) * output
            total += self.attention_flops_per_context_token * context_sum(0, prompt + output)
        return total


def context_sum(start: int, end: int) -> int:
    """Sum of contexts (position + 1) of the tokens at positions start .. end - 1."""
    return (end * (end + 1) - start * (start + 1)) // 2


def torch_has_fast_bf16_matmuls() -> bool:
    """Whether torch's own bf16 matmuls run in oneDNN here. Without AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, as on Zen 3, they fall to a scalar loop: 1.1 GFLOP/s for a 256 x 576 x 1536
    torch.mm in bf16 against 82 in fp32 there (2026-12-02), so a 4096^3 one takes minutes, and
    systems whose matmuls are torch's (HF, vLLM CPU) are not run in bf16 on such a CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def matmul_rates(square_size: int = 4096, reps: int = 3) -> dict:
    """Best-of-``reps`` matmul rate in GFLOP/s for each dtype torch runs at speed here: a square
    torch.mm and a model-shaped linear (bf16 only where torch_has_fast_bf16_matmuls)."""
    rates = {}
    for name, dtype in DTYPES.items():
        if dtype == torch.bfloat16 and not torch_has_fast_bf16_matmuls():
            continue
        rates[name] = {
            f"mm_{square_size}": _gflops(square_size, square_size, square_size, dtype, reps),
            "linear_256x576x1536": _gflops(256, 576, 1536, dtype, reps, inner=20),
        }
        rates[name]["peak"] = max(rates[name].values())
    return rates


def copy_bandwidth(reps: int = 5) -> float:
    """GB/s of the fastest of ``reps`` 512 MiB tensor copies, counting bytes read plus bytes written."""
    src = torch.ones(2**29, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * src.numel() / fastest(lambda: dst.copy_(src), reps) / 1e9


def fastest(fn, reps: int, inner: int = 1) -> float:
    """Seconds per call of ``fn``: the best of ``reps`` timings of ``inner`` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def _gflops(m: int, k: int, n: int, dtype: torch.dtype, reps: int, inner: int = 1) -> float:
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    return 2 * m * k * n / fastest(lambda: torch.mm(a, b), reps, inner) / 1e9


def ceiling(flops: ModelFlops, requests: list, peak_gflops: float, copy_gbs: float, element_size: int) -> dict:
    """The fastest this workload could run if every FLOP ran at the peak matmul rate; and the
    floor of a small-batch decode step: its weights read once at the measured copy bandwidth."""
    total = flops.workload_flops(requests)
    seconds = total / (peak_gflops * 1e9)
    output_tokens = sum(r.max_tokens for r in requests)
    total_tokens = output_tokens + sum(len(r.prompt_token_ids) for r in requests)
    weight_bytes = flops.weight_bytes(element_size)
    return {
        "model": asdict(flops),
        "workload_tflop": total / 1e12,
        "peak_gflops": peak_gflops,
        "output_tokens": output_tokens,
        "total_tokens": total_tokens,
        "ceiling_wall_s": seconds,
        "ceiling_output_tok_s": output_tokens / seconds,
        "ceiling_total_tok_s": total_tokens / seconds,
        "copy_gbs": copy_gbs,
        "weight_bytes": weight_bytes,
        "weight_stream_s": weight_bytes / (copy_gbs * 1e9),
    }
