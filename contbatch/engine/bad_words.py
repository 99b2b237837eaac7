"""Bad words: the token sequences a request may not generate, and the token each forbids next.

A word is forbidden as the tokenizer writes it at the start of a text and after a space
(most BPE vocabularies have a separate token for a word that follows a space). As in vLLM,
only the last token of a sequence is masked, and only when the request's output so far
ends with the tokens before it: a one-token word is never generated, a longer one is cut
before its last token.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BadWordsIds = tuple[tuple[int, ...], ...]


def bad_words_token_ids(tokenizer: "PreTrainedTokenizerBase", words: tuple[str, ...]) -> BadWordsIds:
    """Each word's token sequences (as the text's start, and after a space), without repeats;
    ValueError naming a word that has no tokens."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        word = word.lstrip()
        plain = tuple(tokenizer.encode(word, add_special_tokens=False))
        if not plain:
            raise ValueError(f"SamplingParams.bad_words: {word!r} has no tokens")
        sequences[plain] = None
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        # A spaced form that is a space token and then the plain one is banned by the plain one.
        if spaced[-len(plain) :] != plain:
            sequences[spaced] = None
    return tuple(sequences)


def banned_next(sequences: BadWordsIds, token_ids: list[int], num_output_tokens: int) -> list[int]:
    """The tokens that would complete a bad word next, given a sequence's tokens (prompt and
    output); only the ``num_output_tokens`` last of them may match a word's first tokens."""
    banned = []
    for sequence in sequences:
        before = len(sequence) - 1
        if before == 0 or (before <= num_output_tokens and tuple(token_ids[-before:]) == sequence[:-1]):
            banned.append(sequence[-1])
    return banned
