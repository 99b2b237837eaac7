"""What the transformers path can run, and the KV-cache shape it needs, read from the HF config.

The transformers path runs transformers' own modeling code with contbatch's paged attention
plugged into its attention-function registry (contbatch/models/transformers_backend.py). It
takes a decoder-only text model whose causal-LM class passes attention arguments through to
that registry; everything else is refused here, before any weights load, with the reason.
"""

from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from contbatch import ops
from contbatch.models.config import LAYER_TYPES, read_raw_config

_MAX_KERNEL_HEAD_DIM = 256  # the compiled attention kernels take head sizes that are multiples of 16, up to this


@dataclass(frozen=True)
class TransformersModelConfig:
    """The fields the engine reads (the same names as ``ModelConfig``'s), plus the HF config."""

    architecture: str
    vocab_size: int
    max_position_embeddings: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int, ...]  # per layer, -1: none
    hf_config: PretrainedConfig = field(repr=False, compare=False)


def read_transformers_config(model_dir: Path) -> TransformersModelConfig:
    """The config of a model the transformers path can run; ValueError naming the architecture
    and the reason otherwise."""
    raw = read_raw_config(model_dir)
    declared = raw.get("architectures") or []
    name = declared[0] if declared else raw.get("model_type", "<no architectures or model_type>")
    hf_config = _auto_config(model_dir, name)
    model_class = _causal_lm_class(hf_config, declared, name)
    _check_attention(hf_config, name)
    _check_registry_support(model_class, name)
    try:
        return _build(hf_config, model_class.__name__, name)
    except AttributeError as exc:  # a config without the usual size fields
        raise ValueError(f"{name}: cannot size the KV cache from its config ({exc})") from None


def _build(hf_config: PretrainedConfig, architecture: str, name: str) -> TransformersModelConfig:
    num_heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    _check_head_dim(head_dim, name)
    num_layers = int(hf_config.num_hidden_layers)
    return TransformersModelConfig(
        architecture=architecture,
        vocab_size=int(hf_config.vocab_size),
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", None) or 2048),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_num_kv_heads(hf_config, num_heads),
        head_dim=head_dim,
        sliding_windows=_sliding_windows(hf_config, num_layers, name),
        hf_config=hf_config,
    )


def _auto_config(model_dir: Path, name: str) -> PretrainedConfig:
    try:
        # No remote code: a model whose modeling code is not in transformers itself is refused.
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise ValueError(f"{name}: transformers cannot read {model_dir / 'config.json'} ({exc})") from None


def _causal_lm_class(hf_config: PretrainedConfig, declared: list[str], name: str) -> type:
    """The class transformers loads this model with, if it is a decoder-only text generator."""
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if declared and not causal_names.intersection(declared):
        raise ValueError(
            f"{name} is not a causal language model (transformers' AutoModelForCausalLM does not list it): "
            "only decoder-only text generators can run"
        )
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if model_class is None:
        raise ValueError(
            f"{name}: transformers has no causal-LM class for model_type {hf_config.model_type!r} "
            "(an encoder, vision or audio model?): only decoder-only text generators can run"
        )
    if hf_config.get_text_config() is not hf_config:
        raise ValueError(f"{name} is a multimodal model: the transformers path runs text-only decoders")
    return model_class


def _check_registry_support(model_class: type, name: str) -> None:
    if not model_class.is_backend_compatible():
        raise ValueError(
            f"{name}: transformers' {model_class.__name__} does not pass attention arguments through its "
            "attention-function registry (_supports_attention_backend is False), so the paged KV cache "
            "cannot be plugged in"
        )


def _check_attention(hf_config: PretrainedConfig, name: str) -> None:
    """Attention our kernels cannot compute: causal softmax(q.k * scale) over a window, nothing else."""
    unsupported = {
        "attention softcapping (attn_logit_softcapping)": getattr(hf_config, "attn_logit_softcapping", None),
        "ALiBi position biases": getattr(hf_config, "alibi", False),
        "chunked attention (attention_chunk_size)": getattr(hf_config, "attention_chunk_size", None),
        "bidirectional attention": getattr(hf_config, "use_bidirectional_attention", False)
        or not getattr(hf_config, "is_causal", True),
        "cross-attention (add_cross_attention)": getattr(hf_config, "add_cross_attention", False),
    }
    needed = [feature for feature, value in unsupported.items() if value]
    if needed:
        raise ValueError(f"{name} needs {', '.join(needed)}, which contbatch's paged attention kernels lack")


def _check_head_dim(head_dim: int, name: str) -> None:
    if ops.BACKEND == "native" and (head_dim % 16 or head_dim > _MAX_KERNEL_HEAD_DIM):
        raise ValueError(
            f"{name} has head_dim={head_dim}; the compiled attention kernels need a multiple of 16 "
            f"up to {_MAX_KERNEL_HEAD_DIM}"
        )


def _num_kv_heads(hf_config: PretrainedConfig, num_heads: int) -> int:
    if getattr(hf_config, "multi_query", False):  # GPT-BigCode's one shared K/V head
        return 1
    return int(getattr(hf_config, "num_key_value_heads", None) or num_heads)


def _sliding_windows(hf_config: PretrainedConfig, num_layers: int, name: str) -> tuple[int, ...]:
    """Each layer's window as transformers' masks apply it: per ``layer_types`` where the config
    has them, else ``sliding_window`` on every layer (unless ``use_sliding_window`` is off)."""
    window = getattr(hf_config, "sliding_window", None) or -1
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        uses_window = getattr(hf_config, "use_sliding_window", True)
        return (window if uses_window else -1,) * num_layers
    other = sorted(set(layer_types) - set(LAYER_TYPES))
    if other:
        raise ValueError(f"{name} has {other} layers; the transformers path runs attention layers only "
                         f"({', '.join(LAYER_TYPES)})")
    return tuple(window if kind == "sliding_attention" else -1 for kind in layer_types[:num_layers])
