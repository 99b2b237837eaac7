"""Incremental detokenisation equals decoding the whole sequence, multi-byte characters included."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from contbatch.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The café serves crème brûlée.",
    "日本語のテキストと絵文字 🎉🚀 mixed with English.",
    "Ελληνικά, русский, العربية, हिन्दी — and emoji 👩‍👩‍👧.",
]


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    from contbatch.engine.tokenizer import load_tokenizer

    return load_tokenizer(smollm_dir)


def _stream(tokenizer, token_ids: list[int]) -> tuple[str, list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(t) for t in token_ids]
    deltas.append(detokenizer.flush())
    return detokenizer.text, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    token_ids = tokenizer(text).input_ids
    streamed, deltas = _stream(tokenizer, token_ids)
    assert streamed == tokenizer.decode(token_ids, skip_special_tokens=True) == text
    assert "".join(deltas) == streamed
    assert not any("\ufffd" in d for d in deltas), "a delta split a multi-byte character"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_token_streams_match_full_decode(tokenizer, data):
    text = data.draw(st.sampled_from(TEXTS))
    ids = tokenizer(text).input_ids
    # Random cuts and splices of real token sequences, plus random ids (some decode to partial bytes).
    start = data.draw(st.integers(0, len(ids) - 1))
    extra = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=8))
    token_ids = ids[start:] + extra
    streamed, _ = _stream(tokenizer, token_ids)
    assert streamed == tokenizer.decode(token_ids, skip_special_tokens=True)
