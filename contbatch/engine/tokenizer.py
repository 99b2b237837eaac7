"""Tokenizer loading and the set of end-of-sequence ids a model uses."""

import json
from pathlib import Path

from tokenizers import decoders
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contbatch.models.gguf import gguf_eos_token_ids, gguf_metadata, is_gguf_file, parsed_once


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory, or of a GGUF file (which holds its own)."""
    try:
        if is_gguf_file(model_dir):
            return load_gguf_tokenizer(model_dir)
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {str(model_dir)!r} ({exc}); "
            "pass skip_tokenizer_init=True and token-id prompts to run without one"
        ) from exc


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file holds, as transformers converts it, with what some of its
    releases convert wrongly set as the file says (see _repair_byte_level_bpe)."""
    with parsed_once(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if gguf_metadata(path, "tokenizer.ggml.model") == ["gpt2"] and tokenizer.is_fast:
        eos = gguf_metadata(path, "tokenizer.ggml.eos_token_id")
        _repair_byte_level_bpe(tokenizer, int(eos[0]) if eos else None)
    return tokenizer


def _repair_byte_level_bpe(tokenizer: PreTrainedTokenizerBase, eos_token_id: int | None) -> None:
    """transformers 5.17 (5.24 does not) converts a GGUF file's byte-level BPE tokenizer
    ("gpt2") with two faults. Its decoder runs sentencepiece steps (ByteFallback, Fuse,
    Replace "\u2581") before the ByteLevel one: decoded text comes out the same, but llguidance
    derives each token's bytes from that chain and gets them wrong, so structured outputs
    masked the wrong tokens. And its eos_token is the file's BOS token, which would end every
    generation at the next "<|im_start|>". The ByteLevel decoder alone and the file's EOS
    token are what the file means."""
    backend = tokenizer.backend_tokenizer
    chain = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    byte_level = [step for step in chain.get("decoders", []) if step["type"] == "ByteLevel"]
    if chain.get("type") == "Sequence" and len(byte_level) == 1:
        options = {key: value for key, value in byte_level[0].items() if key != "type"}
        backend.decoder = decoders.ByteLevel(**options)
    if eos_token_id is not None and tokenizer.eos_token_id != eos_token_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_token_id)


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
