"""Tokenizer loading and the set of end-of-sequence ids a model uses."""

import json
from pathlib import Path

from tokenizers import decoders
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contbatch.models.gguf import gguf_eos_token_ids, gguf_metadata, is_gguf_file, parsed_once


# The decoder steps transformers 5.17 puts ahead of the ByteLevel decoder of a byte-level BPE
# tokenizer it converts from a GGUF file (5.24 does not): see _repair_byte_level_decoder.
_SENTENCEPIECE_STEPS = [
    {"type": "ByteFallback"},
    {"type": "Fuse"},
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
]


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory, or of a GGUF file (which holds its own)."""
    try:
        if is_gguf_file(model_dir):
            return load_gguf_tokenizer(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {str(model_dir)!r} ({exc}); "
            "pass skip_tokenizer_init=True and token-id prompts to run without one"
        ) from exc
    _repair_byte_level_decoder(tokenizer)  # a directory transformers 5.17 converted from GGUF
    return tokenizer


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file holds, as transformers converts it, with its decoder repaired
    (_repair_byte_level_decoder) and its EOS token the file's: transformers 5.17 makes a
    byte-level BPE file's BOS token its eos_token, which would end a generation at the next
    "<|im_start|>" (eos_token_ids takes the tokenizer's too)."""
    with parsed_once(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _repair_byte_level_decoder(tokenizer)
    eos = gguf_metadata(path, "tokenizer.ggml.eos_token_id")
    if eos and tokenizer.eos_token_id != int(eos[0]):
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos[0]))
    return tokenizer


def _repair_byte_level_decoder(tokenizer: PreTrainedTokenizerBase) -> None:
    """A byte-level BPE tokenizer whose decoder runs sentencepiece steps (ByteFallback, Fuse,
    Replace "\u2581") before its ByteLevel one gets the ByteLevel decoder alone. Decoded text
    is the same either way (its tokens hold no "\u2581" and no "<0x..>" pieces), but llguidance
    derives each token's bytes from the chain and gets them wrong, so structured outputs
    masked the wrong tokens."""
    decoder = tokenizer.backend_tokenizer.decoder if tokenizer.is_fast else None
    chain = json.loads(decoder.__getstate__()) if decoder is not None else {}
    steps = chain.get("decoders", [])
    if chain.get("type") == "Sequence" and steps[:-1] == _SENTENCEPIECE_STEPS and steps[-1]["type"] == "ByteLevel":
        options = {key: value for key, value in steps[-1].items() if key != "type"}
        tokenizer.backend_tokenizer.decoder = decoders.ByteLevel(**options)


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
