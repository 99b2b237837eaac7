"""When a sequence ends on a token: stop ids (EOS unless ignored, and stop_token_ids) and length.

The output processor is the one place that ends requests; it calls these for the
token-level conditions and handles stop strings and grammars itself. The model runner
uses ``stop_token_ids`` too, to mask those tokens until min_tokens are generated.
"""

from typing import NamedTuple

from contbatch.sampling_params import SamplingParams


class Finish(NamedTuple):
    reason: str  # "stop", "length" or "abort", as vLLM's finish_reason
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


def stop_token_ids(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """Tokens that end the sequence once min_tokens are reached."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)


def token_finish(
    token_id: int,
    stop_ids: frozenset[int],
    params: SamplingParams,
    num_output_tokens: int,
    num_tokens: int,
    max_model_len: int,
) -> Finish | None:
    """The finish a just-sampled token causes, if any (counts include that token)."""
    if token_id in stop_ids and num_output_tokens > params.min_tokens:
        return Finish("stop", token_id if token_id in params.stop_token_ids else None)
    if num_tokens >= max_model_len or (params.max_tokens is not None and num_output_tokens >= params.max_tokens):
        return Finish("length")
    return None
