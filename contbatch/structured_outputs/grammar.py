"""The llguidance side of structured outputs: compiled grammars and per-sequence matchers.

Imported only when a request uses structured outputs (llguidance.torch pulls in
torch._dynamo: ~1.5 s). Masks come from llguidance as bitmasks, one bit per token (int32
words, bit ``i % 32`` of word ``i // 32``), unpacked here to bool rows.
"""

import functools
import json
import logging
import re

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from contbatch.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON is written as json.dumps writes it: ", " and ": " separators, no other
# whitespace (free whitespace lets a model pad forever). A schema's own
# "x-guidance" options override these; separators stay mandatory even with
# whitespace_flexible, so set them too: {"whitespace_flexible": true,
# "item_separator": ",", "key_separator": ":"}.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE_SIZE = 256
# llguidance caps the lexer work of one token mask ("fuel", about 14k units a millisecond).
# Its default, 200k, failed the very first mask of plausible short regexes such as
# "((?:yes)|[a-z]{1,3}[a-c0-2_](?:yes)|[aeiou]?.{1,3}[a-z]{1,3}){1,2}" (found by hypothesis:
# "too many expressions constructed", so every sample ended empty); 10x that served them in
# 3-6 ms and still bounds a pathological mask at about 0.15 s.
STEP_LEXER_FUEL = 2_000_000


def _grammar(params: StructuredOutputsParams) -> tuple[str, str]:
    """(field name, llguidance grammar text); the text is the cache key."""
    if params.choice is not None:
        # Lark string literals take JSON escapes; the lexer refuses a raw DEL, which json.dumps keeps.
        literals = (json.dumps(c).replace("\x7f", "\\u007f") for c in dict.fromkeys(params.choice))
        alternatives = " | ".join(literals)
        return "choice", llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if params.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(non_capturing(params.regex))
    return "json", llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)


def non_capturing(regex: str) -> str:
    """``regex`` with every capturing group, named or not, made non-capturing: the same
    strings match, and groups capture nothing in a constrained output anyway. llguidance
    1.9.1 panics on some alternations of captured literals ("yesyes|yes(yes)": "called
    `Option::unwrap()` on a `None` value") and serves their non-capturing form."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            out.append(regex[i : i + 2])  # an escape, whatever it escapes
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            # A "]" right after "[" or "[^" is a literal member, not the class's end.
            start = i + 1 + (regex[i + 1 : i + 2] == "^")
            if regex[start : start + 1] == "]":
                out.append(regex[i : start + 1])
                i = start + 1
                continue
        elif char == "(":
            name = re.match(r"\(\?P?<(?![=!])\w+>", regex[i:])  # (?P<name> or (?<name>, not lookbehind
            if name is not None:
                out.append("(?:")
                i += name.end()
                continue
            if not regex.startswith("(?", i):
                out.append("(?:")
                i += 1
                continue
        out.append(char)
        i += 1
    return "".join(out)


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer; compiled grammars are cached by spec.

    ``vocab_size`` is the model's (the logits' width), which may exceed the
    tokenizer's; ids past the tokenizer are never allowed. ``eos_token_ids`` are
    allowed exactly where the grammar may end.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise TypeError(f"structured outputs need a fast (Rust) tokenizer, got {type(tokenizer).__name__}")
        if not eos_token_ids or not all(0 <= t < vocab_size for t in eos_token_ids):
            raise ValueError(f"structured outputs need EOS token ids in [0, {vocab_size}), got {sorted(eos_token_ids)}")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        # ~0.5 s for a 50k vocabulary: built once per engine.
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self._compile = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile_uncached)

    def validate(self, params: StructuredOutputsParams) -> None:
        """ValueError, naming the field and llguidance's reason, if the regex or schema is invalid."""
        self._compile(*_grammar(params))

    def matcher(self, params: StructuredOutputsParams) -> "GrammarMatcher":
        """A fresh matcher at the start of the grammar (one per request or sample)."""
        template = self._compile(*_grammar(params))
        return GrammarMatcher(template.deep_copy(), self.vocab_size, self.eos_token_ids)

    def _compile_uncached(self, field: str, grammar: str) -> llguidance.LLMatcher:
        # A template matcher: copying it (~1 us) is far cheaper than building one (~0.5 ms).
        limits = llguidance.LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL)
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits)
        if template.is_error():
            raise ValueError(f"structured_outputs.{field} is invalid: {template.get_error()}")
        # The first mask, on a copy: a grammar past llguidance's limits fails here, before any
        # work starts, rather than on every sample at its first step.
        first = template.deep_copy()
        llguidance.torch.fill_next_token_bitmask(first, llguidance.torch.allocate_token_bitmask(1, self.vocab_size))
        if first.is_error():
            reason = first.get_error().splitlines()[0]  # then llguidance's state dump
            if "NoExtensionBias" in reason:  # no token can start it, e.g. the regex [^\s\S]
                raise ValueError(f"structured_outputs.{field} matches no text: no token can begin a match "
                                 f"(llguidance: {reason})")
            raise ValueError(f"structured_outputs.{field} is too complex for llguidance's limits: {reason}")
        for warning in template.get_grammar_warnings():
            logger.warning("structured_outputs.%s: %s", field, warning)
        return template


class GrammarMatcher:
    """One request's position in its grammar.

    Per step: ``fill_mask`` (or ``blocked_tokens`` for a batch) on the logits, sample,
    then ``accept`` the sampled token. Stop the request when ``is_finished`` or
    when an EOS id was sampled (accepting EOS is allowed but not needed).
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def allowed_tokens(self) -> torch.Tensor:
        """Bool [vocab_size], True where the token may come next (EOS where the grammar may end)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask)
        return ~_blocked(self._bitmask, self.vocab_size)[0]

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place ([vocab_size], any device)."""
        _check_width(logits_row, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask)
        blocked = _blocked(self._bitmask, self.vocab_size)[0].to(logits_row.device, non_blocking=True)
        logits_row.masked_fill_(blocked, float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``; ValueError (state unchanged) if the grammar does not allow it."""
        if token_id in self.eos_token_ids:
            allowed = self._matcher.is_accepting()
        else:
            allowed = 0 <= token_id < self.vocab_size and self._matcher.validate_tokens([token_id]) == 1
        if not allowed or not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the structured output grammar here")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow; also True after an EOS or an
        internal llguidance error (see ``error``), when the mask allows only EOS."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """llguidance's message if the matcher hit an internal limit (e.g. a too complex grammar)."""
        return self._matcher.get_error() or None


def blocked_tokens(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """Bool [len(matchers), vocab_size], True where the token may not come next.

    Computes all masks in one llguidance call (parallel across matchers when there are
    spare cores) and unpacks them at once.
    """
    vocab_size = matchers[0].vocab_size
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab_size)
    llguidance.torch.fill_next_token_bitmask_par(_executor(), [(m._matcher, i) for i, m in enumerate(matchers)], bitmask)
    return _blocked(bitmask, vocab_size)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def _blocked(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size], True where the bitmask's bit is 0 (little-endian words)."""
    bits = np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


def _check_width(logits: torch.Tensor, vocab_size: int) -> None:
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} columns, the grammar's vocab_size is {vocab_size}")
