"""Turning an input record into the prompt dict ``LLM.iter_generate`` takes.

Per-line sampling overrides: any top-level key named like a SamplingParams field
(``"max_tokens": 64``), then a ``"sampling_params"`` object (``{"temperature": 0.7}``)
on top. Other top-level keys are ignored.
"""

import dataclasses

from transformers import PreTrainedTokenizerBase

from contbatch.jobs.reader import RawRecord
from contbatch.sampling_params import SamplingParams

OVERRIDE_KEY = "sampling_params"
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_overrides(data: dict) -> tuple[dict, object]:
    """A record's own sampling, as given: its top-level keys named like a SamplingParams
    field, and its ``"sampling_params"`` value (None when absent)."""
    return {key: value for key, value in data.items() if key in SAMPLING_FIELDS}, data.get(OVERRIDE_KEY)


class RecordBuilder:
    """Builds prompts from records; ``build`` raises ValueError/TypeError for a bad record."""

    def __init__(
        self,
        base_params: SamplingParams,
        prompt_field: str,
        messages_field: str | None,
        tokenizer: PreTrainedTokenizerBase | None,
    ) -> None:
        if messages_field is not None and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
            raise ValueError(
                f"messages_field={messages_field!r} needs a tokenizer with a chat template; this model has none"
            )
        self.base_params = base_params
        self.prompt_field = prompt_field
        self.messages_field = messages_field
        self.tokenizer = tokenizer

    def build(self, record: RawRecord) -> dict:
        if isinstance(record.data, str):
            return {"prompt": record.data}
        if self.messages_field is not None:
            prompt = {"prompt_token_ids": self._chat_token_ids(record.data)}
        else:
            prompt = {"prompt": self._text(record.data)}
        params = self._params(record.data)
        if params is not None:
            prompt["sampling_params"] = params
        return prompt

    def _text(self, data: dict) -> str:
        if self.prompt_field not in data:
            raise ValueError(f"missing field {self.prompt_field!r}")
        text = data[self.prompt_field]
        if not isinstance(text, str):
            raise TypeError(f"field {self.prompt_field!r} must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"field {self.prompt_field!r} is an empty prompt")
        return text

    def _chat_token_ids(self, data: dict) -> list[int]:
        name = self.messages_field
        if name not in data:
            raise ValueError(f"missing field {name!r}")
        messages = data[name]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"field {name!r} must be a non-empty list of {{'role', 'content'}} objects")
        for index, message in enumerate(messages):
            if not (isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))):
                raise ValueError(f"{name}[{index}] must be an object with string 'role' and 'content', got {message!r}")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - templates are user Jinja and raise anything
            raise ValueError(f"the chat template rejected {name!r}: {exc}") from exc
        # The template already holds the special tokens: tokenizing must not add a second BOS.
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _params(self, data: dict) -> SamplingParams | None:
        overrides, nested = sampling_overrides(data)
        if nested is not None:
            if not isinstance(nested, dict):
                raise TypeError(f"field {OVERRIDE_KEY!r} must be an object, got {type(nested).__name__}")
            unknown = sorted(set(nested) - SAMPLING_FIELDS)
            if unknown:
                raise ValueError(
                    f"unknown sampling parameter(s) {unknown} in {OVERRIDE_KEY!r}; known: {sorted(SAMPLING_FIELDS)}"
                )
            overrides.update(nested)
        if not overrides:
            return None
        return dataclasses.replace(self.base_params, **overrides)
