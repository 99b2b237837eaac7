"""StructuredOutputsParams and GrammarCompiler.validate: bad specs fail early, naming the field."""

import dataclasses

import pytest

from contbatch.structured_outputs import StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one of choice, regex or json, got none"),
        ({"choice": ["a"], "regex": "a"}, ValueError, "exactly one of .* got choice, regex"),
        ({"regex": "a", "json": {}}, ValueError, "got regex, json"),
        ({"choice": []}, ValueError, r"structured_outputs\.choice must list at least one"),
        ({"choice": "yes"}, TypeError, r"structured_outputs\.choice must be a list"),
        ({"choice": ["yes", 1]}, TypeError, r"structured_outputs\.choice must contain only strings, got 1"),
        ({"choice": ["yes", ""]}, ValueError, r"structured_outputs\.choice strings must be non-empty"),
        ({"choice": ["\ud800"]}, ValueError, r"structured_outputs\.choice is not valid Unicode"),
        ({"regex": 5}, TypeError, r"structured_outputs\.regex must be a string"),
        ({"regex": ""}, ValueError, r"structured_outputs\.regex must be a non-empty"),
        ({"json": "{not json"}, ValueError, r"structured_outputs\.json is not valid JSON"),
        ({"json": "[1, 2]"}, ValueError, r"structured_outputs\.json must be a JSON object"),
        ({"json": 5}, TypeError, r"structured_outputs\.json must be a dict or a JSON string, got int"),
        ({"json": {"default": object()}}, TypeError, r"structured_outputs\.json must be JSON-serialisable"),
    ],
)
def test_malformed_params_raise_naming_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        StructuredOutputsParams(**kwargs)


def test_choice_is_kept_as_a_tuple_and_params_are_frozen():
    params = StructuredOutputsParams(choice=["yes", "no"])
    assert params.choice == ("yes", "no")
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.regex = "x"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"regex": "a(b"}, r"(?s)structured_outputs\.regex is invalid: .*unclosed group"),
        ({"regex": r"(a)\1"}, r"(?s)structured_outputs\.regex is invalid: .*backreferences are not supported"),
        ({"regex": "(?=a)a"}, r"(?s)structured_outputs\.regex is invalid: .*look-around"),
        ({"json": {"type": "frobnicate"}}, r"structured_outputs\.json is invalid: .*frobnicate"),
        ({"json": '{"type": "object", "properties": {"a": false}, "required": ["a"]}'}, "Unsatisfiable"),
    ],
)
def test_invalid_regex_or_schema_is_rejected_with_llguidance_reason(compiler, kwargs, match):
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match=match):
        compiler.validate(params)
    with pytest.raises(ValueError, match=match):
        compiler.matcher(params)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"choice": ['say "hi"', "back\\slash", "two\nlines", "del\x7f", "snow ☃ 😀"]},
        {"regex": r"^(yes|no)$"},
        {"regex": r"(?P<word>[a-z]+) \d{1,3}"},
        # A pydantic-style schema: titles, descriptions, $defs/$ref, anyOf with null, defaults.
        {
            "json": {
                "$defs": {"Color": {"enum": ["red", "green"], "title": "Color", "type": "string"}},
                "properties": {
                    "name": {"title": "Name", "type": "string", "description": "who"},
                    "color": {"$ref": "#/$defs/Color"},
                    "age": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
                },
                "required": ["name", "color"],
                "title": "Person",
                "type": "object",
            }
        },
    ],
)
def test_valid_specs_pass_validation(compiler, kwargs):
    compiler.validate(StructuredOutputsParams(**kwargs))
