"""ModelConfig: the fields our models need, read from the model's own config.json.

Accepts both transformers 4.x names (rope_theta, rope_scaling) and 5.x names
(rope_parameters), since users have either. Where a family's config.json may leave a
field out, the default is the one transformers' config class for that family gives it.
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The per-layer attention kinds the paged kernels compute (config ``layer_types``)."""


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
    rotary_dim: int  # the leading dims of each head that rotary rotates (Phi-4-mini: 3/4 of them)
    # Per-layer attention (Gemma 3): layer_types[i] is "sliding_attention" (window sliding_window,
    # rope local_rope_theta and local_rope_scaling) or "full_attention" (no window, rope_theta
    # and rope_scaling). None: every layer alike.
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    attention_scale: float | None = None  # None: head_dim**-0.5
    final_logit_softcapping: float | None = None

    @property
    def num_params(self) -> int:
        """Parameters excluding the embedding table, plus the LM head (counted even when tied)."""
        attn = self.hidden_size * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size

    def layer_window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window, -1 for none."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return -1

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """Every layer's sliding window, -1 for none (as TransformersModelConfig has them)."""
        return tuple(self.layer_window(layer) for layer in range(self.num_layers))


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
    return parse_model_config(read_raw_config(model_dir), architectures, model_dir / "config.json")


def parse_model_config(raw: dict, architectures: tuple[str, ...], path: Path) -> ModelConfig:
    """``raw`` (a config.json's contents) for a native model, as ``load_model_config``;
    ``path`` names where it came from (a config.json, a GGUF file) in errors."""
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
    if arch == "Gemma3ForCausalLM":
        return _gemma3(raw)
    config = _llama_family(arch, raw)
    return _phi3(config, raw) if arch == "Phi3ForCausalLM" else config


def _llama_family(arch: str, raw: dict) -> ModelConfig:
    rope_params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise NativeModelLacks(f"{arch}: hidden_act {hidden_act!r} is not supported natively; supported: 'silu'")
    sizes = _sizes(raw, head_dim=raw.get("head_dim"), num_kv_heads=raw.get("num_key_value_heads"))
    return ModelConfig(
        architecture=arch,
        **sizes,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0))),
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
        rotary_dim=sizes["head_dim"],
    )


def _sizes(raw: dict, head_dim: int | None, num_kv_heads: int | None) -> dict:
    """The shape fields every family names alike; head_dim and num_kv_heads as the family
    defaults them (None: hidden_size / num_heads, and num_heads)."""
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads or num_heads),
        head_dim=int(head_dim or hidden // num_heads),
    )


def _sliding_window(arch: str, raw: dict) -> int:
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if raw.get("use_sliding_window", False):
            raise NativeModelLacks(f"{arch}: use_sliding_window=True (per-layer windows) is not supported natively")
        return -1
    return int(window) if window else -1


def _phi3(config: ModelConfig, raw: dict) -> ModelConfig:
    """Phi-3, Phi-3.5 and Phi-4-mini: the Llama layers with partial rotary and LongRoPE, read
    as transformers' Phi3Config reads them (its checkpoints fuse q/k/v and gate/up already)."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    # A factor inside the rope dict wins over the top-level one, as in Phi3Config.
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(config.head_dim * partial)
    return replace(config, rotary_dim=rotary_dim, rope_scaling=_phi3_rope_scaling(config, raw, rope, rotary_dim))


def _phi3_rope_scaling(config: ModelConfig, raw: dict, rope: dict, rotary_dim: int) -> dict | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("su", "yarn"):  # Phi3Config's old names for LongRoPE
        rope_type = "longrope"
    if rope_type == "default":
        return None
    if rope_type != "longrope":
        raise ValueError(f"rope type {rope_type!r}: Phi-3 takes 'default' or 'longrope'")
    # Phi3Config always has a top-level original_max_position_embeddings (default 4096), and
    # transformers gives it priority over the one in the rope dict.
    original = int(raw.get("original_max_position_embeddings", 4096))
    factor = rope.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    for name in ("short_factor", "long_factor"):
        if len(rope[name]) != rotary_dim // 2:
            raise ValueError(f"rope_scaling {name} has {len(rope[name])} values; the rotary dims "
                             f"({rotary_dim}) need {rotary_dim // 2}")
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in rope["short_factor"]],
        "long_factor": [float(f) for f in rope["long_factor"]],
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }


def _gemma3(raw: dict) -> ModelConfig:
    """Gemma 3 text, with Gemma3TextConfig's defaults."""
    arch = "Gemma3ForCausalLM"
    if raw.get("attn_logit_softcapping") is not None:
        raise NativeModelLacks(f"{arch}: attn_logit_softcapping={raw['attn_logit_softcapping']} needs attention "
                               "softcapping, which contbatch's paged attention kernels lack")
    if raw.get("use_bidirectional_attention"):
        raise NativeModelLacks(f"{arch}: use_bidirectional_attention=True; contbatch's attention is causal")
    hidden_act = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if hidden_act != "gelu_pytorch_tanh":
        raise NativeModelLacks(f"{arch}: hidden_activation {hidden_act!r} is not supported natively; "
                               "supported: 'gelu_pytorch_tanh'")
    sizes = _sizes(raw, head_dim=raw.get("head_dim", 256), num_kv_heads=raw.get("num_key_value_heads", 4))
    layer_types = _gemma3_layer_types(raw, sizes["num_layers"])
    (rope_theta, rope_scaling), (local_theta, local_scaling) = _gemma3_ropes(raw)
    window = raw.get("sliding_window", 4096)
    if "sliding_attention" in layer_types and not window:
        raise ValueError(f"sliding_window is {window!r}, but layer_types has sliding_attention layers")
    softcap = raw.get("final_logit_softcapping")
    return ModelConfig(
        architecture=arch,
        **sizes,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_proj_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=False,
        qk_norm=True,
        sliding_window=int(window) if window else -1,
        hidden_act=hidden_act,
        rotary_dim=sizes["head_dim"],
        layer_types=layer_types,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


def _gemma3_layer_types(raw: dict, num_layers: int) -> tuple[str, ...]:
    """From layer_types, or from the older sliding_window_pattern (every n-th layer global)."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = int(raw.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(layer_types) < num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    other = sorted(set(layer_types) - set(LAYER_TYPES))
    if other:
        raise NativeModelLacks(f"Gemma3ForCausalLM: layer types {other} are not supported natively; "
                               f"supported: {', '.join(LAYER_TYPES)}")
    return tuple(layer_types[:num_layers])


def _gemma3_ropes(raw: dict) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((theta, scaling) of the global layers, (theta, scaling) of the sliding ones): 5.x
    nests them under rope_parameters by layer type; 4.x has rope_theta and rope_scaling for
    the global layers and rope_local_base_freq for the sliding ones."""
    nested = raw.get("rope_parameters") or {}
    full = dict(nested.get("full_attention") or {"rope_type": "default"})
    full.update(raw.get("rope_scaling") or {})
    local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    return _theta_and_scaling(full), _theta_and_scaling(local)


def _theta_and_scaling(rope: dict) -> tuple[float, dict | None]:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return float(rope["rope_theta"]), (None if rope_type == "default" else rope)
