"""ModelConfig: the fields our models need, read from the model's own config.json.

Accepts both transformers 4.x names (rope_theta, rope_scaling) and 5.x names
(rope_parameters), since users have either.
"""

import json
from dataclasses import dataclass
from pathlib import Path


class NativeModelLacks(ValueError):
    """The config is well formed, but no native model runs it (an architecture or a feature
    they lack): ``model_impl="auto"`` then tries transformers' modeling code instead."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int  # -1: none
    hidden_act: str

    @property
    def num_params(self) -> int:
        """Parameters excluding the embedding table, plus the LM head (counted even when tied)."""
        attn = self.hidden_size * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size


def read_raw_config(model_dir: Path) -> dict:
    """config.json as a dict, raising ValueError when it is missing or not a JSON object."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


def load_model_config(model_dir: Path, architectures: tuple[str, ...]) -> ModelConfig:
    """Parse config.json for a native model, raising ValueError with the reason when it is
    missing or malformed, NativeModelLacks when it is not one of ``architectures`` or needs a
    feature they lack."""
    path = model_dir / "config.json"
    raw = read_raw_config(model_dir)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in architectures), None)
    if arch is None:
        raise NativeModelLacks(
            f"no native model for architecture {archs or raw.get('model_type')!r} in {path}; "
            f"native models: {', '.join(architectures)}"
        )
    try:
        return _build(arch, raw)
    except NativeModelLacks:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is malformed for {arch}: {exc!r}") from exc


def _build(arch: str, raw: dict) -> ModelConfig:
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise NativeModelLacks(f"{arch}: hidden_act {hidden_act!r} is not supported natively; supported: 'silu'")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and none on o_proj; the others follow attention_bias.
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        o_proj_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_sliding_window(arch, raw),
        hidden_act=hidden_act,
    )


def _sliding_window(arch: str, raw: dict) -> int:
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if raw.get("use_sliding_window", False):
            raise NativeModelLacks(f"{arch}: use_sliding_window=True (per-layer windows) is not supported natively")
        return -1
    return int(window) if window else -1
