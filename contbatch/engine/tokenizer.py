"""Tokenizer loading and the set of end-of-sequence ids a model uses."""

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contbatch.models.gguf import gguf_eos_token_ids, is_gguf_file, parsed_once


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory, or of a GGUF file (which holds its own)."""
    try:
        if is_gguf_file(model_dir):
            with parsed_once(model_dir):
                return AutoTokenizer.from_pretrained(str(model_dir.parent), gguf_file=model_dir.name)
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {str(model_dir)!r} ({exc}); "
            "pass skip_tokenizer_init=True and token-id prompts to run without one"
        ) from exc


def eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """Every EOS id from generation_config.json and config.json (or a GGUF file's metadata) and
    the tokenizer (models list several)."""
    ids = gguf_eos_token_ids(model_dir) if is_gguf_file(model_dir) else _config_eos_ids(model_dir)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _config_eos_ids(model_dir: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            try:
                ids |= _as_ids(json.loads(path.read_text()).get("eos_token_id"))
            except (json.JSONDecodeError, AttributeError):
                continue
    return ids


def _as_ids(value: object) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()
