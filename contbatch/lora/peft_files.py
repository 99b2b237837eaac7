"""A PEFT LoRA adapter directory read into one ``LoRAPair`` per adapted linear layer of our model.

PEFT (``PeftModel.save_pretrained``) writes ``adapter_config.json`` and
``adapter_model.safetensors`` whose tensors are named after the base checkpoint's modules:
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]). The update of a layer is ``scaling * B @ A @ x`` with scaling ``lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``); ``rank_pattern`` and ``alpha_pattern`` override r
and alpha for the modules they match, by PEFT's rule (a key matches a module name that ends
with it after a dot). Our model fuses q/k/v and gate/up into one layer each
(contbatch/models/loader.py), so an adapter's pieces of a fused layer are stacked into one pair.

Anything PEFT can save that this does not compute is refused by name before any weight is
attached: DoRA, trained biases, ``modules_to_save``, adapted embeddings or LM head.
"""

import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from contbatch.layers.linear import Linear
from contbatch.lora.layers import LoRAPair
from contbatch.models.config import ModelConfig
from contbatch.models.loader import fused_target

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class _Piece:
    """One checkpoint module's A and B, and where its output goes in our (fused) layer."""

    def __init__(self, module: str, first_row: int, rows: int | None) -> None:
        self.module, self.first_row, self.rows = module, first_row, rows
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.scaling = 1.0


def read_adapter(path: str, model: nn.Module, max_rank: int) -> dict[str, LoRAPair]:
    """Our adapted layers' names (``layers.3.self_attn.qkv_proj``) -> their update; ValueError
    naming the file, tensor or setting where the directory is not an adapter we can serve
    on ``model``, or its rank exceeds ``max_rank``."""
    directory = Path(path)
    settings = _read_settings(directory)
    pieces = _read_pieces(directory, model.config)
    by_layer: dict[str, list[_Piece]] = {}
    for module, piece in pieces.items():
        rank = _checked_rank(module, piece, settings, max_rank, path)
        alpha = _matching(settings.get("alpha_pattern"), module, settings.get("lora_alpha", 8))
        piece.scaling = alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)
        layer = fused_target(module + ".weight", model.config)[0].removesuffix(".weight")
        by_layer.setdefault(layer, []).append(piece)
    return {layer: _stacked(_adapted_linear(model, layer, path), parts) for layer, parts in by_layer.items()}


def _read_settings(directory: Path) -> dict:
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter {str(directory)!r} is not a directory (lora_path must be a PEFT adapter directory)")
    file = directory / CONFIG_FILE
    try:
        settings = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter file {str(file)!r} is not readable JSON: {exc}") from None
    if not isinstance(settings, dict) or settings.get("peft_type", "LORA") != "LORA":
        kind = settings.get("peft_type") if isinstance(settings, dict) else type(settings).__name__
        raise ValueError(f"{str(file)!r}: peft_type is {kind!r}; only 'LORA' adapters are supported")
    refused = {
        "use_dora": "DoRA (use_dora=true)",
        "fan_in_fan_out": "fan_in_fan_out=true (Conv1D layers)",
        "modules_to_save": "modules_to_save (fully trained modules)",
    }
    for key, what in refused.items():
        if settings.get(key):
            raise ValueError(f"{str(file)!r}: {what} is not supported; only plain LoRA on linear layers is")
    if settings.get("bias", "none") != "none":
        raise ValueError(f"{str(file)!r}: bias={settings['bias']!r} is not supported; only bias='none' is")
    return settings


def _read_pieces(directory: Path, config: ModelConfig) -> dict[str, _Piece]:
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        hint = " (adapter_model.bin is not read: save it with safe_serialization=True)" if (
            directory / "adapter_model.bin").exists() else ""
        raise ValueError(f"LoRA adapter {str(directory)!r} has no {WEIGHTS_FILE}{hint}")
    pieces: dict[str, _Piece] = {}
    try:
        with safe_open(str(file), framework="pt") as tensors:
            for key in tensors.keys():
                match = _KEY.match(key)
                if match is None:
                    raise ValueError(f"{str(file)!r}: tensor {key!r} is not a LoRA A/B weight of a linear layer; "
                                     "only those are supported (no DoRA magnitudes, biases, embeddings)")
                module = match["module"]
                if not module.startswith("model.layers."):
                    raise ValueError(f"{str(file)!r}: tensor {key!r} adapts {module!r}; only the decoder "
                                     "layers' linear layers can be adapted (not the embeddings or LM head)")
                if module not in pieces:
                    _, first_row, rows = fused_target(module + ".weight", config)
                    pieces[module] = _Piece(module, first_row, rows)
                setattr(pieces[module], match["part"].lower(), tensors.get_tensor(key).float())
    except SafetensorError as exc:
        raise ValueError(f"LoRA adapter file {str(file)!r} is incomplete or not safetensors: {exc}") from None
    if not pieces:
        raise ValueError(f"{str(file)!r} holds no LoRA weights")
    for module, piece in pieces.items():
        if piece.a is None or piece.b is None:
            raise ValueError(f"{str(file)!r}: {module!r} has lora_{'A' if piece.a is None else 'B'} missing")
    return pieces


def _checked_rank(module: str, piece: _Piece, settings: dict, max_rank: int, path: str) -> int:
    rank = _matching(settings.get("rank_pattern"), module, settings.get("r", piece.a.shape[0]))
    if piece.a.shape[0] != rank or piece.b.shape[1] != rank:
        raise ValueError(f"LoRA adapter {path!r}: {module!r} has A {list(piece.a.shape)} and B "
                         f"{list(piece.b.shape)}, not rank {rank} as its adapter_config.json says")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank} ({module!r}), over max_lora_rank={max_rank}; "
                         f"pass LLM(..., max_lora_rank={rank}) or more")
    return rank


def _matching(pattern: dict | None, module: str, default: float) -> float:
    """PEFT's rank_pattern/alpha_pattern rule: the first key that the module name ends with."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _adapted_linear(model: nn.Module, layer: str, path: str) -> Linear:
    try:
        module = model.get_submodule(layer)
    except AttributeError:
        module = None
    if not isinstance(module, Linear):
        raise ValueError(f"LoRA adapter {path!r} adapts {layer!r}, which this model has no linear layer for")
    return module


def _stacked(linear: Linear, parts: list[_Piece]) -> LoRAPair:
    """One pair for a layer: the parts' A rows stacked, each part's scaled B in its output rows."""
    rank = sum(part.a.shape[0] for part in parts)
    b = torch.zeros(linear.out_features, rank)
    column = 0
    for part in parts:
        rows = linear.out_features if part.rows is None else part.rows
        expected_a, expected_b = (part.a.shape[0], linear.in_features), (rows, part.a.shape[0])
        if tuple(part.a.shape) != expected_a or tuple(part.b.shape) != expected_b:
            raise ValueError(f"LoRA weights of {part.module!r} are A {list(part.a.shape)} and B "
                             f"{list(part.b.shape)}; this model's layer needs A [r, {linear.in_features}] and "
                             f"B [{rows}, r]: the adapter was trained for another base model")
        b[part.first_row : part.first_row + rows, column : column + part.a.shape[0]] = part.b * part.scaling
        column += part.a.shape[0]
    return LoRAPair(torch.cat([part.a for part in parts]).T.contiguous(), b.T.contiguous())
