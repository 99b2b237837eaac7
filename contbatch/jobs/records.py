"""Turning an input record into the prompt dict ``LLM.iter_generate`` takes.

Per-line sampling overrides live under one key, ``"sampling_params"``
(``{"sampling_params": {"temperature": 0.7, "structured_outputs": {"choice": ["yes", "no"]}}}``).
Every other key is the user's metadata and never changes sampling, even when it is named
like a sampling field (``"n": 3``); such keys are warned about once per job, since earlier
versions read them as overrides.
"""

import logging

from transformers import PreTrainedTokenizerBase

from contbatch.jobs.adapters import JobAdapters, named_adapter
from contbatch.jobs.reader import LORA_KEY, OVERRIDE_KEY, RawRecord
from contbatch.prompts import render_conversation, validate_conversation
from contbatch.sampling_params import SAMPLING_FIELDS, SamplingParams, with_overrides

logger = logging.getLogger("contbatch.jobs")


def sampling_overrides(data: dict) -> object:
    """A record's own sampling, as given: its ``"sampling_params"`` value (None when absent)."""
    return data.get(OVERRIDE_KEY)


class RecordBuilder:
    """Builds prompts from records; ``build`` raises ValueError/TypeError for a bad record."""

    def __init__(
        self,
        base_params: SamplingParams,
        prompt_field: str,
        messages_field: str | None,
        tokenizer: PreTrainedTokenizerBase | None,
        adapters: JobAdapters | None = None,
    ) -> None:
        """``adapters``: the job's, where its LLM serves LoRA adapters (None: a record that
        names one is a bad record)."""
        if messages_field is not None and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
            raise ValueError(
                f"messages_field={messages_field!r} needs a tokenizer with a chat template; this model has none"
            )
        self.base_params = base_params
        self.prompt_field = prompt_field
        self.messages_field = messages_field
        self.tokenizer = tokenizer
        self.adapters = adapters
        self._warned = False  # about top-level fields named like sampling parameters

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
        adapter = named_adapter(record.data)
        if adapter is not None:
            if self.adapters is None:
                raise ValueError(f"field {LORA_KEY!r} names a LoRA adapter, but this job runs without LoRA: "
                                 "pass --enable-lora (llm_kwargs={'enable_lora': True}) or --lora DIR")
            prompt["lora_request"] = self.adapters.request(adapter)
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
        conversation = validate_conversation(data[name], f"field {name!r}")
        return render_conversation(self.tokenizer, conversation, f"field {name!r}")[1]

    def _params(self, data: dict) -> SamplingParams | None:
        self._warn_about_top_level_fields(data)
        overrides = sampling_overrides(data)
        if overrides is None:
            return None
        if not isinstance(overrides, dict):
            raise TypeError(f"field {OVERRIDE_KEY!r} must be an object, got {type(overrides).__name__}")
        return with_overrides(self.base_params, overrides, repr(OVERRIDE_KEY)) if overrides else None

    def _warn_about_top_level_fields(self, data: dict) -> None:
        if self._warned:
            return
        named_like_sampling = sorted(SAMPLING_FIELDS.intersection(data))
        if named_like_sampling:
            self._warned = True
            logger.warning(
                "input fields %s are named like sampling parameters but are kept as metadata and do not change "
                "sampling; put per-line overrides under %r", named_like_sampling, OVERRIDE_KEY,
            )
