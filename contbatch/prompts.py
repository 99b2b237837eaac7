"""Turning what users pass as prompts into validated token ids.

Accepted prompt forms: a string, a list of token ids, or a dict with "prompt" and/or
"prompt_token_ids" (vLLM's TextPrompt / TokensPrompt; given both, the ids are used and
the text is reported), optionally with a "sampling_params" entry that overrides the
call's SamplingParams for that prompt, and a "lora_request" entry that overrides the call's
LoRA adapter for it (how a lazy stream or a PromptQueue gives each prompt its own).
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from contbatch.lora.request import LoRARequest
from contbatch.sampling_params import SamplingParams

MAX_LISTED_ERRORS = 20
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "sampling_params", "lora_request"})


@dataclass
class PreparedPrompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams | None = None  # what it runs with: its own override, else the call's (None: not paired yet)
    prompt_logprobs_from: int = 1  # with prompt logprobs: the first prompt position scored
    lora_request: LoRARequest | None = None  # its own adapter (None: the call's)


class PromptPreparer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        max_model_len: int,
        vocab_size: int,
        check_params: Callable[[SamplingParams], None],
        load_lora: Callable[[LoRARequest], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.check_params = check_params
        self.load_lora = load_lora  # reads and checks an adapter once (LLMEngine.load_lora)

    def prepare(self, prompt: object, call_params: SamplingParams | None = None) -> PreparedPrompt:
        """Token ids for one prompt, run with its own SamplingParams if it carries them, else
        ``call_params`` (already checked), whose ``truncate_prompt_tokens`` applies before the
        length check, and with its own LoRA adapter if it names one (read and checked here);
        ValueError/TypeError saying what is wrong with it."""
        text, token_ids = self._split(prompt)
        if text is not None:
            _check_unicode(text)
        params = _own(prompt, "sampling_params", SamplingParams, "a SamplingParams")
        if params is not None:
            self.check_params(params)
        else:
            params = call_params
        lora_request = _own(prompt, "lora_request", LoRARequest, "a LoRARequest or None")
        if lora_request is not None:
            self.load_lora(lora_request)
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this LLM was built with skip_tokenizer_init=True")
            if not text:
                raise ValueError("prompt is an empty string")
            token_ids = self.tokenizer(text).input_ids
        if not token_ids:
            raise ValueError("prompt has no tokens")
        if params is not None and params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-self._truncated_length(params.truncate_prompt_tokens) :]
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} allows at most "
                f"{self.max_model_len - 1} (one position must remain for generated tokens)"
            )
        return PreparedPrompt(text, list(token_ids), params, lora_request=lora_request)

    def _truncated_length(self, truncate_prompt_tokens: int) -> int:
        """The prompt tokens ``truncate_prompt_tokens`` keeps: -1 keeps all a prompt may have."""
        return self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def prepare_all(self, prompts: Sequence, call_params: Iterable[SamplingParams]) -> list[PreparedPrompt]:
        """Validate a whole list before any work, each prompt with its entry of ``call_params``:
        one ValueError lists every offending index."""
        prepared, errors = [], []
        for index, (prompt, params) in enumerate(zip(prompts, call_params)):
            try:
                prepared.append(self.prepare(prompt, params))
            except (TypeError, ValueError) as exc:
                errors.append(f"prompts[{index}]: {exc}")
        raise_if_invalid(errors, "prompt(s)")
        return prepared

    @staticmethod
    def _split(prompt: object) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, dict):
            unknown = sorted(map(repr, set(prompt) - PROMPT_KEYS))
            if unknown:  # a misspelt "sampling_params" would otherwise be ignored
                raise ValueError(f"unknown key(s) {', '.join(unknown)} in a dict prompt; known: "
                                 f"{', '.join(map(repr, sorted(PROMPT_KEYS)))}")
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


def raise_if_invalid(errors: list[str], what: str) -> None:
    """One ValueError listing every invalid input (the first MAX_LISTED_ERRORS of them), if any."""
    if errors:
        shown = "; ".join(errors[:MAX_LISTED_ERRORS])
        more = f" (and {len(errors) - MAX_LISTED_ERRORS} more)" if len(errors) > MAX_LISTED_ERRORS else ""
        raise ValueError(f"{len(errors)} invalid {what}, nothing was run: {shown}{more}")


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


def _own(prompt: object, key: str, kind: type, allowed: str) -> object | None:
    """A dict prompt's own override at ``key`` (None where it has none); TypeError unless a ``kind``."""
    if not isinstance(prompt, dict) or prompt.get(key) is None:
        return None
    value = prompt[key]
    if not isinstance(value, kind):
        raise TypeError(f"a prompt's {key!r} must be {allowed}, got {type(value).__name__}")
    return value


def _check_unicode(text: str) -> None:
    """A lone surrogate (e.g. from a badly decoded file) is not text a tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"prompt has a lone surrogate {text[exc.start]!r} at character {exc.start}, which is not "
                         "valid Unicode text (was the input decoded with errors='surrogateescape'?)") from None


def validate_conversation(conversation: object, where: str) -> list[dict]:
    """One conversation as a list of messages, each with a str 'role' and a 'content', a str or
    a list of OpenAI-style content parts ({"type": "text", "text": ...}), which become one
    string, joined by newlines, as vLLM joins them for text-only templates. ValueError or
    TypeError naming ``where`` (e.g. "conversation 3") and the message."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise TypeError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                        f"got {type(conversation).__name__}")
    messages = []
    for position, message in enumerate(conversation):
        at = f"{where}, message {position}"
        if not isinstance(message, dict):
            raise TypeError(f"{at} must be a {{'role': ..., 'content': ...}} dict, got {type(message).__name__}")
        missing = [key for key in ("role", "content") if key not in message]
        if missing:
            raise ValueError(f"{at} has no {' or '.join(repr(k) for k in missing)} (keys: {sorted(message)})")
        if not isinstance(message["role"], str):
            raise TypeError(f"{at}: 'role' must be a str, got {type(message['role']).__name__}")
        content = _content_text(message["content"], at)
        _check_unicode(content)
        messages.append({**message, "content": content})
    return messages


def _content_text(content: object, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"{at}: 'content' must be a str or a list of parts, got {type(content).__name__}")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = repr(kind) if kind is not None else type(part).__name__
            raise ValueError(f"{at}, content part {index}: only {{'type': 'text', 'text': str}} parts are served "
                             f"(the models here read text only), got {shown}")
        texts.append(part["text"])
    return "\n".join(texts)


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation goes through the chat template; vLLM's LLM.chat arguments of the
    same names. ``continue_final_message`` leaves the last message open for the model to go
    on with (an assistant prefill), so it excludes ``add_generation_prompt``;
    ``chat_template_kwargs`` are passed to the template as variables, ``tools`` as its tools."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message=True continues the last message, so it needs "
                             "add_generation_prompt=False (which opens a new one)")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TypeError(f"chat_template must be a str or None, got {type(self.chat_template).__name__}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(self.chat_template_kwargs).__name__}")
        if self.tools is not None and not (isinstance(self.tools, list) and all(isinstance(t, dict) for t in self.tools)):
            raise TypeError(f"tools must be a list of dicts or None, got {self.tools!r}")


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"'prompt' must be a str, got {type(value).__name__}")
    return value


def _token_list(value: object) -> list[int]:
    if not isinstance(value, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise TypeError("token-id prompts must be lists of ints")
    return list(value)


def render_conversation(
    tokenizer, conversation: list[dict], where: str, options: ChatTemplateOptions = ChatTemplateOptions()
) -> tuple[str, list[int]]:
    """A validated conversation through the tokenizer's chat template: its text and token ids.
    ValueError naming ``where`` (e.g. "conversation 3") if the template fails. Shared by
    ``LLM.chat`` and bulk jobs' messages records."""
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, chat_template=options.chat_template,
            tools=options.tools, **(options.chat_template_kwargs or {}),
        )  # fmt: skip
    except Exception as exc:  # the template is the model's own Jinja code and raises anything: name where
        raise ValueError(f"{where}: the chat template failed: {type(exc).__name__}: {exc}") from exc
    # The template already holds any BOS it wants: do not let the tokenizer add another.
    return text, tokenizer(text, add_special_tokens=False).input_ids
