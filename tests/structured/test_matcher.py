"""GrammarMatcher and GrammarCompiler behaviour the engine relies on: masks, EOS, accept, batching."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.layers.sampler import _apply_masks
from contbatch.structured_outputs import StructuredOutputsParams, grammar
from contbatch.structured_outputs.grammar import GrammarCompiler, blocked_tokens, non_capturing
from tests.structured.conftest import EOS_ID, VOCAB_SIZE
from tests.structured.test_random_walks import _regexes

YES_NO = StructuredOutputsParams(choice=["yes", "no"])
PERSON = StructuredOutputsParams(
    json={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
)


def accept_text(tokenizer, matcher, text: str) -> None:
    for token_id in tokenizer.encode(text):
        matcher.accept(token_id)


def allowed_ids(matcher) -> set[int]:
    return set(matcher.allowed_tokens().nonzero().flatten().tolist())


def test_choice_finishes_and_then_allows_only_eos(tokenizer, compiler):
    matcher = compiler.matcher(YES_NO)
    assert {tokenizer.decode([t]) for t in allowed_ids(matcher)} == {"y", "ye", "yes", "n", "no"}
    assert not matcher.is_finished
    accept_text(tokenizer, matcher, "yes")
    assert matcher.is_finished
    assert allowed_ids(matcher) == {EOS_ID}
    matcher.accept(EOS_ID)  # allowed, not required
    assert matcher.is_finished


def test_eos_is_allowed_where_the_grammar_may_end_but_more_may_follow(tokenizer, compiler):
    matcher = compiler.matcher(StructuredOutputsParams(regex="[0-9]{1,3}"))
    assert EOS_ID not in allowed_ids(matcher)
    accept_text(tokenizer, matcher, "4")
    assert EOS_ID in allowed_ids(matcher) and not matcher.is_finished
    matcher.accept(EOS_ID)
    assert matcher.is_finished


def test_disallowed_tokens_raise_and_leave_the_matcher_usable(tokenizer, compiler):
    matcher = compiler.matcher(YES_NO)
    for bad in [tokenizer.encode("maybe")[0], EOS_ID, VOCAB_SIZE, -1]:
        with pytest.raises(ValueError, match=f"token {bad} is not allowed"):
            matcher.accept(bad)
    accept_text(tokenizer, matcher, "no")
    assert matcher.is_finished and matcher.error is None


def test_fill_mask_matches_allowed_tokens_along_a_path(tokenizer, compiler):
    matcher = compiler.matcher(PERSON)
    for token_id in tokenizer.encode('{"a": 12, "b": [true, false]}'):
        logits = torch.randn(VOCAB_SIZE)
        matcher.fill_mask(logits)
        assert torch.equal(torch.isfinite(logits), matcher.allowed_tokens())
        matcher.accept(token_id)
    assert matcher.is_finished


def test_json_is_written_with_json_dumps_separators_unless_the_schema_says_otherwise(tokenizer, compiler):
    matcher = compiler.matcher(PERSON)
    with pytest.raises(ValueError):
        accept_text(tokenizer, matcher, '{"a":1')
    options = {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"}
    flexible = {**PERSON.json, "x-guidance": options}
    accept_text(tokenizer, compiler.matcher(StructuredOutputsParams(json=flexible)), '{"a":1 ,\n "b":[ ]}')


def test_batched_masks_equal_fill_mask_per_row(tokenizer, compiler):
    specs = [YES_NO, PERSON, StructuredOutputsParams(regex=r"\d+"), PERSON]
    matchers = [compiler.matcher(spec) for spec in specs]
    accept_text(tokenizer, matchers[3], '{"a": 7')
    rows = [4, 0, 2, 3]  # row 1 is an unconstrained request
    logits = torch.randn(5, VOCAB_SIZE)
    expected = logits.clone()
    for row, matcher in zip(rows, matchers):
        matcher.fill_mask(expected[row])
    _apply_masks(logits, rows, blocked_tokens(matchers))
    assert torch.equal(logits, expected)


def test_logits_of_the_wrong_width_are_refused(compiler):
    matcher = compiler.matcher(YES_NO)
    with pytest.raises(ValueError, match="columns"):
        matcher.fill_mask(torch.zeros(VOCAB_SIZE + 1))
    with pytest.raises(ValueError, match="columns"):
        _apply_masks(torch.zeros(2, VOCAB_SIZE - 1), [0], blocked_tokens([matcher]))


def test_matchers_of_one_spec_are_independent(tokenizer, compiler):
    first, second = compiler.matcher(YES_NO), compiler.matcher(YES_NO)
    accept_text(tokenizer, first, "yes")
    assert first.is_finished and not second.is_finished
    accept_text(tokenizer, second, "no")


def test_model_vocab_wider_than_tokenizer_and_several_eos_ids(tokenizer):
    wide = VOCAB_SIZE + 64
    compiler = GrammarCompiler(tokenizer, wide, frozenset({0, EOS_ID}))
    matcher = compiler.matcher(YES_NO)
    assert matcher.allowed_tokens().shape == (wide,)
    accept_text(tokenizer, matcher, "no")
    assert allowed_ids(matcher) == {0, EOS_ID}
    logits = torch.zeros(wide)
    matcher.fill_mask(logits)
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [0, EOS_ID]
    matcher.accept(0)
    assert matcher.is_finished


def test_compiler_refuses_missing_or_out_of_range_eos(tokenizer):
    with pytest.raises(ValueError, match="EOS token ids"):
        GrammarCompiler(tokenizer, VOCAB_SIZE, frozenset())
    with pytest.raises(ValueError, match="EOS token ids"):
        GrammarCompiler(tokenizer, VOCAB_SIZE, frozenset({VOCAB_SIZE}))


# llguidance 1.9.1 panicked compiling these ("called `Option::unwrap()` on a `None` value");
# their non-capturing forms compile (found by hypothesis in the engine test).
CAPTURED_ALTERNATIONS = ["yesyes|yes(yes)", "(?:yes)(?:yes)|(?:yes)((?:yes))", "abc|a(bc)", "yesyes|(?P<w>yes)yes"]


@pytest.mark.parametrize("regex", CAPTURED_ALTERNATIONS)
def test_regexes_with_capturing_groups_compile_and_match_only_their_strings(tokenizer, compiler, regex):
    matcher = compiler.matcher(StructuredOutputsParams(regex=regex))
    text = re.sub(r"\(\?P<\w+>|\(\?:|[()]", "", regex.split("|")[0])  # the first alternative's string
    accept_text(tokenizer, matcher, text)
    assert matcher.is_finished and re.fullmatch(regex, text)
    with pytest.raises(ValueError, match="not allowed"):
        compiler.matcher(StructuredOutputsParams(regex=regex)).accept(tokenizer.encode("no")[0])


@given(regex=_regexes(), data=st.data())
@settings(max_examples=60, deadline=None)
def test_non_capturing_matches_the_same_strings_and_captures_nothing(regex, data):
    rewritten = non_capturing(regex)
    assert re.compile(rewritten).groups == 0
    for original, other in ((regex, rewritten), (rewritten, regex)):
        text = data.draw(st.from_regex(original, fullmatch=True))
        assert re.fullmatch(other, text), (text, original, other)


@pytest.mark.parametrize(
    "regex, expected",
    [
        (r"(a)(?:b)(?P<n>c)(?<m>d)", r"(?:a)(?:b)(?:c)(?:d)"),
        (r"(?=a)(?!b)(?<=c)(?<!d)(e)", r"(?=a)(?!b)(?<=c)(?<!d)(?:e)"),  # lookaround left alone
        (r"\((x)\)", r"\((?:x)\)"),  # escaped parentheses are literals
        (r"[(][^(]x[]()](y)[\]()](z)", r"[(][^(]x[]()](?:y)[\]()](?:z)"),  # so are class members
    ],
)
def test_non_capturing_rewrites_groups_only(regex, expected):
    assert non_capturing(regex) == expected


# With llguidance's default lexer fuel (200k) the first mask of this regex failed ("too
# many expressions constructed"), so every sample ended empty; with STEP_LEXER_FUEL it serves.
FUEL_HUNGRY = "((?:yes)|((?:yes)|[a-z]{1,3}[a-c0-2_](?:yes))|((?:no)|[aeiou]?.{1,3}[a-z]{1,3})[a-z]?){1,2}"


def test_a_regex_past_the_default_lexer_fuel_serves(tokenizer, compiler):
    matcher = compiler.matcher(StructuredOutputsParams(regex=FUEL_HUNGRY))
    assert matcher.allowed_tokens().any() and matcher.error is None
    accept_text(tokenizer, matcher, "yesno")
    assert matcher.error is None and re.fullmatch(FUEL_HUNGRY, "yesno")


def test_a_grammar_past_the_lexer_limits_is_refused_when_validated(tokenizer, monkeypatch):
    monkeypatch.setattr(grammar, "STEP_LEXER_FUEL", 200_000)  # llguidance's default
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, frozenset([EOS_ID]))
    with pytest.raises(ValueError, match=r"structured_outputs.regex is too complex .*too many expressions"):
        compiler.validate(StructuredOutputsParams(regex=FUEL_HUNGRY))


@pytest.mark.parametrize("regex", [r"[^\s\S]", r"a[^\s\S]b"])
def test_a_regex_that_matches_nothing_is_refused_as_such(compiler, regex):
    with pytest.raises(ValueError, match=r"structured_outputs.regex matches no text: no token can begin a match"):
        compiler.validate(StructuredOutputsParams(regex=regex))
