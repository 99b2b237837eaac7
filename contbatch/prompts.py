"""Turning what users pass as prompts into validated token ids.

Accepted prompt forms: a string, a list of token ids, or a dict with "prompt" and/or
"prompt_token_ids" (vLLM's TextPrompt / TokensPrompt; given both, the ids are used and
the text is reported), optionally with a "sampling_params" entry that overrides the
call's SamplingParams for that prompt.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from contbatch.sampling_params import SamplingParams

MAX_LISTED_ERRORS = 20


@dataclass
class PreparedPrompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams | None = None  # the prompt's own override, if it carried one


class PromptPreparer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        max_model_len: int,
        vocab_size: int,
        check_params: Callable[[SamplingParams], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.check_params = check_params

    def prepare(self, prompt: object) -> PreparedPrompt:
        """Token ids for one prompt; ValueError/TypeError saying what is wrong with it."""
        text, token_ids = self._split(prompt)
        own_params = _own_params(prompt)
        if own_params is not None:
            self.check_params(own_params)
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this LLM was built with skip_tokenizer_init=True")
            if not text:
                raise ValueError("prompt is an empty string")
            token_ids = self.tokenizer(text).input_ids
        if not token_ids:
            raise ValueError("prompt has no tokens")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} allows at most "
                f"{self.max_model_len - 1} (one position must remain for generated tokens)"
            )
        return PreparedPrompt(text, list(token_ids), own_params)

    def prepare_all(self, prompts: Sequence) -> list[PreparedPrompt]:
        """Validate a whole list before any work: one ValueError lists every offending index."""
        prepared, errors = [], []
        for index, prompt in enumerate(prompts):
            try:
                prepared.append(self.prepare(prompt))
            except (TypeError, ValueError) as exc:
                errors.append(f"prompts[{index}]: {exc}")
        if errors:
            shown = "; ".join(errors[:MAX_LISTED_ERRORS])
            more = f" (and {len(errors) - MAX_LISTED_ERRORS} more)" if len(errors) > MAX_LISTED_ERRORS else ""
            raise ValueError(f"{len(errors)} invalid prompt(s), nothing was run: {shown}{more}")
        return prepared

    @staticmethod
    def _split(prompt: object) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, dict):
            if "prompt" not in prompt and "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
            text = _text(prompt["prompt"]) if "prompt" in prompt else None
            token_ids = _token_list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else None
            return text, token_ids
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, (list, tuple)):
            return None, _token_list(prompt)
        raise TypeError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")


def as_prompt_iterable(prompts: object) -> tuple[Iterable, bool]:
    """(prompts as an iterable, whether it is a materialised sequence) for generate()'s input forms."""
    if isinstance(prompts, (str, dict)):
        return [prompts], True
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)], True  # one prompt given as token ids
        return prompts, True
    if isinstance(prompts, Iterable):
        return prompts, False
    raise TypeError(f"prompts must be a str, a list of prompts or an iterable, got {type(prompts).__name__}")


def _own_params(prompt: object) -> SamplingParams | None:
    if not isinstance(prompt, dict) or prompt.get("sampling_params") is None:
        return None
    params = prompt["sampling_params"]
    if not isinstance(params, SamplingParams):
        raise TypeError(f"a prompt's 'sampling_params' must be a SamplingParams, got {type(params).__name__}")
    return params


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"'prompt' must be a str, got {type(value).__name__}")
    return value


def _token_list(value: object) -> list[int]:
    if not isinstance(value, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise TypeError("token-id prompts must be lists of ints")
    return list(value)
