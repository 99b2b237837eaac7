"""A model's own sampling defaults, from its ``generation_config.json``, as vLLM reads them.

vLLM (``generation_config="auto"``, its default) runs prompts given no SamplingParams with the
model's recommended settings: those of ``repetition_penalty``, ``temperature``, ``top_k``,
``top_p``, ``min_p`` and ``max_new_tokens`` (as ``max_tokens``) that the file sets, over
SamplingParams' own defaults. Qwen2.5's file, for one, sets temperature 0.7, top_p 0.8, top_k 20
and repetition_penalty 1.05; a model without the file, or a GGUF file, has none.
"""

import logging
from pathlib import Path

from transformers import GenerationConfig

from contbatch.sampling_params import SamplingParams

logger = logging.getLogger("contbatch")

GENERATION_CONFIGS = ("auto", "vllm")
FILE = "generation_config.json"
_SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                  "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def sampling_defaults(model: Path, generation_config: str) -> dict:
    """SamplingParams fields the model's file sets ({} with "vllm", or without a file);
    ValueError for another ``generation_config`` or a file transformers cannot read."""
    if generation_config not in GENERATION_CONFIGS:
        raise ValueError(f"generation_config must be one of {', '.join(map(repr, GENERATION_CONFIGS))}, "
                         f"got {generation_config!r}")
    if generation_config == "vllm" or not model.is_dir() or not (model / FILE).is_file():
        return {}
    try:
        given = GenerationConfig.from_pretrained(model).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(model / FILE)!r} is not a readable generation config: {exc}") from exc
    defaults = {field: given[key] for key, field in _SAMPLING_KEYS.items() if given.get(key) is not None}
    if defaults:
        logger.info("default sampling parameters from %s: %s (generation_config='vllm' keeps SamplingParams' own)",
                    model / FILE, defaults)
    return defaults


def default_sampling_params(model: Path, generation_config: str) -> SamplingParams:
    """SamplingParams() with the model's recommended settings over it (what ``LLM``, bulk jobs
    and the Ray processor run prompts given no SamplingParams with); ValueError naming the
    file where they are not valid SamplingParams values. Reads no weights."""
    defaults = sampling_defaults(model, generation_config)
    try:
        return SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{str(model / FILE)!r}: {exc} (LLM(generation_config='vllm') "
                         "ignores the file's sampling settings)") from exc
