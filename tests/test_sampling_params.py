"""SamplingParams validation: every bad value names its field, the value and the allowed range."""

import pytest

from contbatch import SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("temperature", -0.1, ValueError),
        ("temperature", float("nan"), ValueError),
        ("temperature", "hot", TypeError),
        ("top_p", 0.0, ValueError),
        ("top_p", 1.5, ValueError),
        ("top_k", -2, ValueError),
        ("top_k", 1.5, TypeError),
        ("min_p", -0.1, ValueError),
        ("min_p", 1.1, ValueError),
        ("max_tokens", 0, ValueError),
        ("max_tokens", True, TypeError),
        ("min_tokens", -1, ValueError),
        ("min_tokens", 100, ValueError),
        ("seed", -1, ValueError),
        ("stop_token_ids", [-3], ValueError),
        ("stop_token_ids", 5, TypeError),
        ("ignore_eos", "yes", TypeError),
    ],
)
def test_invalid_values_raise_naming_the_field(field, value, error):
    with pytest.raises(error, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value)[:8] in str(info.value) or field == "stop_token_ids"


def test_valid_values_are_kept():
    params = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.1, max_tokens=7, min_tokens=3, seed=4)
    assert params.greedy and params.top_k == 5 and params.min_tokens == 3


@pytest.mark.parametrize(
    ("field", "value", "bad", "bound"),
    [
        ("seed", 2**64, 2**64, "2**64 - 1"),
        ("seed", 2**70, 2**70, "2**64 - 1"),
        ("top_k", 2**63, 2**63, "2**63 - 1"),
        ("max_tokens", 2**63, 2**63, "2**63 - 1"),
        ("n", 2**63, 2**63, "2**63 - 1"),
        ("stop_token_ids", [5, 2**63], 2**63, "2**63 - 1"),
        ("temperature", 1e39, 1e39, "3.4e38"),
    ],
)
def test_values_past_what_torch_takes_are_refused_naming_the_range(field, value, bad, bound):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert f"SamplingParams.{field}" in message and bound in message and repr(bad) in message


def test_the_edges_of_the_ranges_are_accepted():
    params = SamplingParams(seed=2**64 - 1, top_k=2**63 - 1, max_tokens=2**63 - 1, stop_token_ids=[2**63 - 1])
    assert params.seed == 2**64 - 1 and params.stop_token_ids == [2**63 - 1]


def test_validate_catches_a_field_changed_after_construction():
    params = SamplingParams(seed=1)
    params.seed = 2**70
    with pytest.raises(ValueError, match=r"SamplingParams\.seed"):
        params.validate()


def test_structured_outputs_dict_becomes_params_and_bad_keys_are_named():
    from contbatch.structured_outputs import StructuredOutputsParams

    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert tuple(params.structured_outputs.choice) == ("yes", "no")
    with pytest.raises(ValueError, match=r"takes the keys choice, regex or json, got \['grammar'\]"):
        SamplingParams(structured_outputs={"grammar": "x"})
    with pytest.raises(ValueError, match="exactly one of choice, regex or json"):
        SamplingParams(structured_outputs={"choice": ["a"], "regex": "a"})


def test_max_tokens_none_is_accepted_and_bounds_min_tokens_by_nothing():
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    with pytest.raises(ValueError, match="max_tokens must be None or >= 1"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize(
    ("field", "value", "error", "allowed"),
    [
        ("logit_bias", [(1, 2.0)], TypeError, "a dict {token id: bias}"),
        ("logit_bias", {"x": 1.0}, ValueError, "keyed by token ids"),
        ("logit_bias", {-1: 1.0}, ValueError, "keyed by token ids"),
        ("logit_bias", {True: 1.0}, ValueError, "keyed by token ids"),
        ("logit_bias", {5: float("inf")}, ValueError, "a finite float32 for each token (token 5)"),
        ("logit_bias", {5: "high"}, TypeError, "a finite float32"),
        ("allowed_token_ids", [], ValueError, "a non-empty list of token ids"),
        ("allowed_token_ids", 7, ValueError, "a non-empty list of token ids"),
        ("allowed_token_ids", [3, -1], ValueError, "in [0, 2**63 - 1] (each id)"),
        ("bad_words", "word", ValueError, "a list of non-blank strings"),
        ("bad_words", ["ok", "  "], ValueError, "a list of non-blank strings"),
        ("bad_words", [3], ValueError, "a list of non-blank strings"),
        ("truncate_prompt_tokens", 0, ValueError, "-1 (max_model_len - 1) or >= 1"),
        ("truncate_prompt_tokens", -2, ValueError, "-1 (max_model_len - 1) or >= 1"),
        ("truncate_prompt_tokens", 2.5, TypeError, "-1 (max_model_len - 1) or >= 1"),
    ],
)
def test_token_restrictions_are_checked_naming_the_field(field, value, error, allowed):
    with pytest.raises(error) as info:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}" in str(info.value) and allowed in str(info.value)


def test_token_restrictions_are_normalised():
    params = SamplingParams(logit_bias={"13": 2, 7: -1.5}, allowed_token_ids=(4, 5), bad_words=["a", "b", "a"])
    assert params.logit_bias == {13: 2.0, 7: -1.5} and params.allowed_token_ids == [4, 5]
    assert params.bad_words == ["a", "b"]
