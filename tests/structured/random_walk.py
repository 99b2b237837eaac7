"""Drive a GrammarMatcher with random tokens instead of a model, the way the engine would:
mask, pick an allowed token, accept it, stop when the grammar is finished or EOS is picked."""

import random
from dataclasses import dataclass

import torch

from contbatch.structured_outputs.grammar import GrammarMatcher

CLOSERS = '"}],'
LOOKAHEAD_SAMPLE = 300


@dataclass
class Walk:
    token_ids: list[int]  # without the final EOS
    text: str
    finished: bool  # the grammar finished or EOS was picked (not cut off by the step cap)
    eos_allowed: list[bool]  # at each step, whether EOS was allowed before it
    error: str | None = None  # llguidance hit an internal limit (its mask then allows only EOS)


class RandomChooser:
    """Uniform over the allowed tokens, biased toward EOS and tokens that close a JSON
    value. After ``soft_cap`` steps it takes EOS when allowed, else a token after which the
    grammar may end, else one of the shortest allowed tokens, mostly closing ones, so that
    most walks finish."""

    def __init__(self, tokenizer, eos_id: int, soft_cap: int = 40, hard_cap: int = 200) -> None:
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.soft_cap = soft_cap
        self.hard_cap = hard_cap
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        # Byte-level BPE pieces spell one character per byte.
        byte_of = _byte_level_alphabet()
        self.token_bytes = [bytes(byte_of.get(ch, 0) for ch in piece) for piece in pieces]
        self.num_bytes = torch.tensor([len(piece) for piece in pieces])
        self.closing = torch.tensor([any(c in piece for c in CLOSERS) for piece in pieces])

    def walk(self, matcher: GrammarMatcher, seed: int) -> Walk:
        rng = random.Random(seed)
        token_ids, eos_allowed = [], []
        for step in range(self.hard_cap):
            if matcher.is_finished:
                return Walk(token_ids, self.decode(token_ids), True, eos_allowed)
            allowed = matcher.allowed_tokens()
            if matcher.error is not None:  # e.g. "lexer error: too many expressions constructed"
                return Walk(token_ids, self.decode(token_ids), True, eos_allowed, matcher.error)
            eos_allowed.append(bool(allowed[self.eos_id]))
            closing_now = step >= self.soft_cap
            if eos_allowed[-1] and rng.random() < (1.0 if closing_now else 0.3):
                matcher.accept(self.eos_id)
                assert matcher.is_finished
                return Walk(token_ids, self.decode(token_ids), True, eos_allowed)
            token_id = self._pick(matcher, allowed, rng, closing_now)
            matcher.accept(token_id)
            token_ids.append(token_id)
        return Walk(token_ids, self.decode(token_ids), matcher.is_finished, eos_allowed)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text_or_none(self, token_ids: list[int]) -> str | None:
        """The text of ``token_ids``, or None while it ends inside a UTF-8 character."""
        try:
            return b"".join(self.token_bytes[t] for t in token_ids).decode("utf-8")
        except UnicodeDecodeError:
            return None

    def _pick(self, matcher: GrammarMatcher, allowed: torch.Tensor, rng: random.Random, closing_now: bool) -> int:
        allowed[self.eos_id] = False
        candidates = allowed.nonzero().flatten()
        assert len(candidates), "the grammar allows neither EOS nor any token"
        if closing_now:
            # Shortest tokens: where a loop of long tokens goes on, the way out is a short one.
            lengths = self.num_bytes[candidates]
            shortest = candidates[lengths == lengths.min()].tolist()
            others = rng.sample(candidates.tolist(), min(len(candidates), LOOKAHEAD_SAMPLE))
            ending = self._tokens_that_may_end(matcher, shortest + others)
            if ending:
                return rng.choice(ending)
            candidates = torch.tensor(shortest)
        closing = candidates[self.closing[candidates]]
        if len(closing) and rng.random() < (0.9 if closing_now else 0.3):
            candidates = closing
        return int(candidates[rng.randrange(len(candidates))])

    def _tokens_that_may_end(self, matcher: GrammarMatcher, token_ids: list[int]) -> list[int]:
        """The tokens after which the grammar may end, each tried on llguidance's matcher and rolled back."""
        inner = matcher._matcher
        ending = []
        for token_id in token_ids:
            assert inner.consume_token(token_id)
            if inner.is_accepting():
                ending.append(token_id)
            inner.rollback(1)
        return ending


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
