"""Incremental detokenisation that never splits a multi-byte character.

Each new token decodes a short window of recent tokens twice: without and with the
new token. The difference is the new text. While the window ends in an incomplete
UTF-8 sequence (decoded as U+FFFD) nothing is emitted and the window grows, so a
character split across byte-level tokens appears whole once its last byte arrives.
Decoding a window rather than one token keeps tokenizer-specific joining (leading
spaces, byte fallback) identical to decoding the whole sequence.
"""

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self._decode_ids = _decoder(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # window start: context so the next token decodes as in the full text
        self.read_offset = 0  # tokens before this are already in self.text
        self.finished = False

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        if self.finished:
            return ""
        self.token_ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a request: emit whatever is left, incomplete characters included."""
        return "" if self.finished else self._emit(final=True)

    def truncate(self, length: int) -> None:
        """Cut the text (at a stop string) and ignore anything after."""
        self.text = self.text[:length]
        self.finished = True

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self.text += delta
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids) if token_ids else ""


def _decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` as a function of the ids. A fast tokenizer that does no clean-up of
    spaces returns exactly its Rust backend's decode; calling that directly saves ~2.5 us of
    Python per call, two calls per generated token (1.3 ms of a 256-sequence decode step)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
