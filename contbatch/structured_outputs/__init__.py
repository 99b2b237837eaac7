"""Structured outputs: constrain a request's output to a choice, a regex or a JSON schema.

Built on llguidance rather than xgrammar (both run on the CPU): llguidance builds its
token masks lazily from the tokenizer's trie at each step, so a new schema needs no
per-vocabulary precompilation (labeling jobs send many distinct schemas), it installs as
one self-contained wheel with no build step, and its torch helpers fill the masks of a
whole batch in one parallel call. This package is the one owner of structured outputs: ``StructuredOutputsParams`` (the
spec, checked at construction), and the engine's ``StructuredOutputManager``, which
compiles specs (through ``grammar.GrammarCompiler``, one per tokenizer, cached by spec),
keeps one ``GrammarMatcher`` per sequence (a forked sample gets a fresh one), makes each
step's token masks, and advances matchers on the sampled tokens.
"""

import json
import logging
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from contbatch.engine.stopping import Finish
from contbatch.layers.sampler import TokenMasks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must be; set exactly one field.

    Attributes:
        choice: non-empty strings; the output is exactly one of them (kept as a tuple).
        regex: the whole output must match it. Python's syntax minus lookaround and
            backreferences (llguidance speaks Rust's regex dialect): ``.`` excludes newline,
            ``\\d``/``\\w``/``\\s`` are Unicode-aware, ``^``/``$`` only at the ends.
        json: a JSON schema (dict or JSON string); the output is JSON that validates
            against it, written with ", " and ": " separators and no other whitespace
            unless the schema's ``"x-guidance"`` options say otherwise (see ``JSON_OPTIONS``).

    Regexes and schemas are checked against llguidance when the request is added
    (``ValueError`` with its reason): compiled, and their first token mask computed, so a
    grammar past llguidance's limits is refused before any work starts. Capturing groups
    are passed on as non-capturing (the same strings match). The fields' types are checked
    here.
    """

    choice: tuple[str, ...] | list[str] | None = None
    regex: str | None = None
    json: dict | str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("choice", "regex", "json") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of choice, regex or json, got {', '.join(given) or 'none'}"
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", _checked_choice(self.choice))
        elif self.regex is not None:
            _check_regex(self.regex)
        else:
            _check_json(self.json)


def _checked_choice(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
        raise TypeError(f"structured_outputs.choice must be a list of strings, got {choice!r}")
    if not choice:
        raise ValueError("structured_outputs.choice must list at least one string, got []")
    for item in choice:
        if not isinstance(item, str):
            raise TypeError(f"structured_outputs.choice must contain only strings, got {item!r}")
        if not item:
            raise ValueError(f"structured_outputs.choice strings must be non-empty, got {choice!r}")
        _check_utf8("choice", item)
    return tuple(choice)


def _check_regex(regex: object) -> None:
    if not isinstance(regex, str):
        raise TypeError(f"structured_outputs.regex must be a string, got {regex!r}")
    if not regex:
        raise ValueError("structured_outputs.regex must be a non-empty regex, got ''")
    _check_utf8("regex", regex)


def _check_utf8(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"structured_outputs.{field} is not valid Unicode ({e.reason}): {text!r}") from None


def _check_json(schema: object) -> None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON ({e}): {schema!r}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json must be a JSON object (a schema), got {schema!r}")
    elif isinstance(schema, dict):
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise TypeError(f"structured_outputs.json must be JSON-serialisable ({e})") from None
    else:
        raise TypeError(f"structured_outputs.json must be a dict or a JSON string, got {type(schema).__name__}")


class StructuredOutputManager:
    """Grammar matchers of one engine's sequences, keyed by seq_id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._compiler = None  # built on first use: llguidance is imported only then
        self.matchers: dict[int, object] = {}

    def validate(self, spec: StructuredOutputsParams) -> None:
        """ValueError, naming the field and llguidance's reason, if the regex or schema is invalid."""
        self._grammar_compiler().validate(spec)

    def add(self, seq_id: int, spec: StructuredOutputsParams) -> None:
        """A fresh matcher at the start of the grammar for the sequence (a request or a forked sample)."""
        self.matchers[seq_id] = self._grammar_compiler().matcher(spec)

    def masks(self, seq_ids: list[int]) -> TokenMasks | None:
        """The tokens each of ``seq_ids`` with a grammar may not sample next; None if none has one."""
        constrained = [seq_id for seq_id in seq_ids if seq_id in self.matchers]
        if not constrained:
            return None
        from contbatch.structured_outputs.grammar import blocked_tokens

        return TokenMasks(constrained, blocked_tokens([self.matchers[seq_id] for seq_id in constrained]))

    def accept(self, seq_id: int, token_id: int) -> Finish | None:
        """Advance the sequence's matcher past its sampled token: "stop" once the grammar is
        complete, "abort" if llguidance failed internally (then its mask allowed only EOS, so
        the token is EOS and would otherwise read as a normal stop)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return None
        if matcher.error is not None:
            logger.warning("sequence %d: the structured output grammar failed (%s); ending it", seq_id, matcher.error)
            return Finish("abort")
        try:
            matcher.accept(token_id)
        except ValueError as exc:  # only an llguidance internal error gets past the mask
            logger.warning("sequence %d: %s (%s); ending it", seq_id, exc, matcher.error)
            return Finish("abort")
        return Finish("stop") if matcher.is_finished else None

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def clear(self) -> None:
        self.matchers.clear()

    def _grammar_compiler(self):
        if self._compiler is None:
            if self._tokenizer is None:
                raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init=True was given)")
            from contbatch.structured_outputs.grammar import GrammarCompiler

            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos_token_ids)
        return self._compiler
