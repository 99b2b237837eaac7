"""Pick a model's path (native or transformers), build it and load its safetensors weights
(sharded too) or a GGUF file's.

A native model is created on the meta device (no random init, no memory), materialised
empty in the target dtype, and each checkpoint tensor is copied straight into its
parameter (or its slice of a fused one), so the full state dict never exists twice.
Any other decoder-only model runs on transformers' own modeling code with contbatch's
paged attention (contbatch/models/transformers_backend.py). A GGUF file (contbatch/models/gguf.py)
loads the same way into a native model; its linear layers stored as Q8_0 take the file's
8-bit blocks as they are.
"""

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from contbatch.config import Quantization
from contbatch.layers.linear import Linear
from contbatch.models.config import ModelConfig, NativeModelLacks, load_model_config
from contbatch.models.gemma3 import Gemma3ForCausalLM
from contbatch.models.gguf import GGUFTensor, gguf_tensors, is_gguf_file, read_gguf_config
from contbatch.models.llama import LlamaForCausalLM
from contbatch.models.transformers_config import TransformersModelConfig, read_transformers_config
from contbatch.ops.int8_blocks import Int8Blocks

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}

# Checkpoint name fragment -> (fused parameter fragment, shard index in the fused matrix).
_FUSED: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}

# Architectures whose checkpoints hold qkv_proj and gate_up_proj fused already, in our
# [q | k | v] and [gate | up] order: each loads whole into its parameter.
_FUSED_IN_CHECKPOINT = frozenset({"Phi3ForCausalLM"})


logger = logging.getLogger(__name__)


def read_config(model_dir: Path, model_impl: str = "auto") -> ModelConfig | TransformersModelConfig:
    """The config of the path that will run the model (its type says which), or ValueError
    naming the problem (missing, malformed, an architecture neither path can run).
    ``model_dir`` may be a GGUF file instead, which runs on the native models only.

    ``model_impl`` (``EngineConfig.model_impl``): "native" takes contbatch's own model only,
    "transformers" transformers' modeling code only, "auto" the native model when it can run
    the config, else transformers' code."""
    if is_gguf_file(model_dir):
        return _gguf_config(model_dir, model_impl)
    if model_dir.is_file():
        raise ValueError(f"model {str(model_dir)!r} is a file; pass the model's directory (config.json, "
                         "*.safetensors and tokenizer files) or a .gguf file")
    if not model_dir.is_dir():
        raise ValueError(f"model directory {str(model_dir)!r} does not exist")
    if model_impl == "transformers":
        config = read_transformers_config(model_dir)
        logger.info("%s: running transformers' modeling code on contbatch's paged attention", config.architecture)
        return config
    try:
        config = load_model_config(model_dir, tuple(ARCHITECTURES))
    except NativeModelLacks as native_refusal:
        if model_impl == "native":
            raise ValueError(f"{native_refusal} (model_impl='native'; 'auto' or 'transformers' would try "
                             "transformers' modeling code)") from None
        return _transformers_instead(model_dir, native_refusal)
    logger.info("%s: running contbatch's native model", config.architecture)
    return config


def _gguf_config(path: Path, model_impl: str) -> ModelConfig:
    if model_impl == "transformers":
        raise ValueError(f"model {str(path)!r} is a GGUF file, which runs on contbatch's native models only; "
                         "model_impl='transformers' takes a model directory")
    config = read_gguf_config(path)
    logger.info("%s from a GGUF file: running contbatch's native model", config.architecture)
    return config


def _transformers_instead(model_dir: Path, native_refusal: NativeModelLacks) -> TransformersModelConfig:
    try:
        config = read_transformers_config(model_dir)
    except ValueError as refusal:
        raise ValueError(f"{refusal}; contbatch's native models cannot run it either ({native_refusal})") from None
    logger.info("%s: running transformers' modeling code on contbatch's paged attention (%s)",
                config.architecture, native_refusal)
    return config


def load_model(
    model_dir: Path,
    config: ModelConfig | TransformersModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: Quantization | None = None,
) -> nn.Module:
    gguf = is_gguf_file(model_dir)
    files = [] if gguf else sorted(model_dir.glob("*.safetensors"))
    if not (gguf or files):
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors weights")
    if isinstance(config, TransformersModelConfig):
        # Imported here: transformers' modeling code takes ~1.7 s to import, which the native
        # models never need.
        from contbatch.models.transformers_backend import load_transformers_model

        return load_transformers_model(model_dir, config, dtype, device, quantization)
    with torch.device("meta"):
        model = ARCHITECTURES[config.architecture](config)
    model = model.to(dtype=dtype).to_empty(device=device)
    embedding_blocks: Int8Blocks | None = None
    if gguf:
        # The int8 kernels run on the CPU only; elsewhere Q8_0 tensors load densely (exactly).
        embedding_blocks = _load_gguf_weights(model, config, model_dir, int8=device.type == "cpu")
    else:
        _load_weights(model, config, files)
    model.init_rotary(max_positions)
    model.pack_weights(quantization, embedding_blocks)
    return model.eval()


def _load_weights(model: nn.Module, config: ModelConfig, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    all_zero = True
    for file in files:
        try:
            all_zero &= _load_file(file, params, config, loaded)
        except SafetensorError as exc:
            raise ValueError(f"weights file {str(file)!r} is incomplete or not a safetensors file ({exc}); "
                             "download or convert it again") from None
    missing = [n for n in _expected_checkpoint_names(params, config) if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    if all_zero:
        logger.warning("every weight in the checkpoint at %s is zero: its outputs will be meaningless "
                       "(a placeholder file or a failed export?)", files[0].parent)


def _load_file(file: Path, params: dict[str, torch.Tensor], config: ModelConfig, loaded: set[str]) -> bool:
    """Copies one safetensors file's tensors into ``params``; True if they are all zero."""
    all_zero = True
    with safe_open(str(file), framework="pt") as checkpoint:
        for name in checkpoint.keys():
            target = _target_name(name, _fusion(config))
            if target is None or (config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if target[0] not in params:
                raise ValueError(f"checkpoint tensor {name!r} in {file.name} has no place in {config.architecture}")
            tensor = checkpoint.get_tensor(name)
            all_zero = all_zero and not bool(tensor.any())  # stops looking at the first nonzero tensor
            _copy_into(params[target[0]], target[1], tensor, config, name)
            loaded.add(name)
    return all_zero


def _load_gguf_weights(model: nn.Module, config: ModelConfig, path: Path, int8: bool) -> Int8Blocks | None:
    """Copies a GGUF file's tensors into ``model``; with ``int8``, a linear layer whose tensors
    are all Q8_0 takes their 8-bit blocks instead. Returns, with ``int8``, the blocks of a
    Q8_0 embedding table (a tied LM head reads them, as llama.cpp runs it, and an int8
    lookup keeps them), else None."""
    params = dict(model.named_parameters())
    expected = _expected_checkpoint_names(params, config)
    tensors = gguf_tensors(path, config, expected)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ValueError(f"GGUF file {str(path)!r} is missing {len(missing)} tensors, e.g. {missing[:3]}")
    int8_layers = _q8_0_layers(model, config, tensors) if int8 else {}
    for name, tensor in tensors.items():
        target, shard = _target_name(name, _fusion(config))
        if target not in int8_layers:
            _copy_into(params[target], shard, tensor.dense(), config, name)
    for target, names in int8_layers.items():
        blocks = _fused_blocks(params[target], [(name, tensors[name]) for name in names], config)
        model.get_submodule(target.removesuffix(".weight")).quantize_int8(blocks)
    table = tensors.get("model.embed_tokens.weight")
    return table.int8_blocks() if int8 and table.is_q8_0 else None


def _q8_0_layers(model: nn.Module, config: ModelConfig, tensors: dict[str, GGUFTensor]) -> dict[str, list[str]]:
    """Linear layers' weight names -> their checkpoint tensors in fused order (q|k|v, gate|up),
    for the layers whose tensors are all Q8_0."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for name in tensors:
        target, shard = _target_name(name, _fusion(config))
        groups.setdefault(target, []).append((shard or 0, name))
    return {target: [name for _, name in sorted(group)] for target, group in groups.items()
            if _is_linear_weight(model, target) and all(tensors[name].is_q8_0 for _, name in group)}


def _is_linear_weight(model: nn.Module, param_name: str) -> bool:
    module_name, _, kind = param_name.rpartition(".")
    return kind == "weight" and isinstance(model.get_submodule(module_name), Linear)


def _fused_blocks(param: torch.Tensor, pieces: list[tuple[str, GGUFTensor]], config: ModelConfig) -> Int8Blocks:
    """A layer's Q8_0 pieces as one matrix: their rows (values and scales alike) concatenated,
    each piece checked against the slice of ``param`` it stands for."""
    blocks = []
    for name, tensor in pieces:
        piece = tensor.int8_blocks()
        slice_shape = _destination(param, _target_name(name, _fusion(config))[1], config, name).shape
        _check_shape(name, (piece.values.shape[0], piece.in_features), tuple(slice_shape))
        blocks.append(piece)
    values, scales = torch.cat([b.values for b in blocks]), torch.cat([b.scales for b in blocks])
    return Int8Blocks(values, scales, blocks[0].in_features)


def _fusion(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """The checkpoint's separate projections that fill slices of our fused ones."""
    return {} if config.architecture in _FUSED_IN_CHECKPOINT else _FUSED


def _target_name(checkpoint_name: str, fusion: dict[str, tuple[str, int]]) -> tuple[str, int | None] | None:
    """Our parameter name (and fused shard) for a checkpoint tensor; None to ignore it."""
    if "rotary_emb.inv_freq" in checkpoint_name:
        return None
    name = checkpoint_name.removeprefix("model.")
    for fragment, (fused, shard) in fusion.items():
        if fragment in name:
            return name.replace(fragment, fused), shard
    return name, None


def fused_target(checkpoint_name: str, config: ModelConfig) -> tuple[str, int, int | None]:
    """Where a checkpoint weight (``model.layers.0.self_attn.q_proj.weight``) lives in our model:
    the parameter's name, and the first row and row count of the slice it fills in a fused
    parameter (0 and None for a whole parameter). Read by LoRA adapters, which name their
    layers as the checkpoint does."""
    target, shard = _target_name(checkpoint_name, _fusion(config))
    if shard is None:
        return target, 0, None
    sizes = _shard_sizes(checkpoint_name, config)
    return target, sum(sizes[:shard]), sizes[shard]


def _copy_into(param: torch.Tensor, shard: int | None, tensor: torch.Tensor, config: ModelConfig, name: str) -> None:
    with torch.no_grad():
        destination = _destination(param, shard, config, name)
        _check_shape(name, tuple(tensor.shape), tuple(destination.shape))
        destination.copy_(tensor)


def _destination(param: torch.Tensor, shard: int | None, config: ModelConfig, name: str) -> torch.Tensor:
    """``param``, or the rows of it that fused shard ``shard`` fills."""
    if shard is None:
        return param
    sizes = _shard_sizes(name, config)
    return param.narrow(0, sum(sizes[:shard]), sizes[shard])


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, expected {expected}")


def _shard_sizes(checkpoint_name: str, config: ModelConfig) -> list[int]:
    if "self_attn." in checkpoint_name:
        kv_size = config.num_kv_heads * config.head_dim
        return [config.num_heads * config.head_dim, kv_size, kv_size]
    return [config.intermediate_size, config.intermediate_size]


def _expected_checkpoint_names(params: dict[str, torch.Tensor], config: ModelConfig) -> list[str]:
    names = []
    fusion = _fusion(config)
    for name in params:
        unfused = [fragment for fragment, (fused, _) in fusion.items() if fused in name]
        variants = [name.replace(fusion[f][0], f) for f in unfused] if unfused else [name]
        names.extend(v if v.startswith("lm_head") else f"model.{v}" for v in variants)
    return names
