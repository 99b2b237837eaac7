"""Structured outputs through the whole engine on SmolLM2: sampled at temperature 1 with n
parallel samples (each with its own grammar state), every output finishes and parses / matches."""

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contbatch import LLM, SamplingParams
from contbatch.structured_outputs import StructuredOutputsParams
from tests.structured.test_random_walks import _regexes, _schemas, choice_lists

SETTINGS = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Room for the largest outputs the bounded schemas allow in practice: a two-level object
# with a dozen rare-character keys took more than 96 tokens. Samples stop when their
# grammar lets them; the budget only has to be out of the way (max_model_len is 512).
MAX_TOKENS = 384
MAX_ARRAY_ITEMS = 2
SAMPLES = 3
PROMPTS = ["Answer with one word.", "Give me some data as JSON."]

# A real model, unlike a random walk, happily repeats itself for ever inside an unbounded
# loop ("yesyesyes..."): give it grammars that must end, so every sample has to finish.
# The strategy puts unbounded loops only at the end of top-level alternatives: drop them.
bounded_regexes = _regexes().map(lambda regex: re.sub(r"(?<!\\)[*+](?=\||$)", "", regex))


def _bounded(schema: dict) -> dict:
    """The schema with a length cap on every string, array and integer. Arrays are capped at
    two items whatever the strategy drew: four 5-character enum strings of rare characters
    already take about 100 tokens, so a sample could end on max_tokens instead of "stop"."""
    schema = dict(schema)
    kind = schema.get("type")
    if kind == "string":
        schema.setdefault("maxLength", 8)
    elif kind == "integer":
        schema.setdefault("minimum", -50)
        schema.setdefault("maximum", 10**6)
    elif kind == "array":
        schema["maxItems"] = min(schema.get("maxItems", MAX_ARRAY_ITEMS), MAX_ARRAY_ITEMS)
        schema["items"] = _bounded(schema["items"])
    elif kind == "object":
        schema["properties"] = {name: _bounded(value) for name, value in schema["properties"].items()}
    return schema


@pytest.fixture(scope="module")
def llm(smollm_dir):
    return LLM(smollm_dir, dtype="auto", max_model_len=512, kv_cache_memory=64 << 20, max_num_seqs=32)


def _run(llm, spec: StructuredOutputsParams, seed: int) -> list:
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=SAMPLES, seed=seed, structured_outputs=spec)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == len(PROMPTS) * SAMPLES
    assert all(c.finish_reason == "stop" for c in completions), [c.text for c in completions]
    return [c.text for c in completions]


@SETTINGS
@given(choices=choice_lists, seed=st.integers(0, 2**31))
def test_every_sample_is_one_of_the_choices(llm, choices, seed):
    texts = _run(llm, StructuredOutputsParams(choice=choices), seed)
    assert all(text in choices for text in texts), (texts, choices)


@SETTINGS
@given(regex=bounded_regexes, seed=st.integers(0, 2**31))
def test_every_sample_matches_the_regex(llm, regex, seed):
    for text in _run(llm, StructuredOutputsParams(regex=regex), seed):
        assert re.fullmatch(regex, text), (text, regex)


@SETTINGS
@given(schema=_schemas().map(_bounded), seed=st.integers(0, 2**31))
def test_every_sample_validates_against_the_schema(llm, schema, seed):
    for text in _run(llm, StructuredOutputsParams(json=schema), seed):
        jsonschema.validate(json.loads(text), schema)


def test_mixed_batch_of_grammars_and_free_text(llm):
    specs = [StructuredOutputsParams(choice=["yes", "no"]), None, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
             StructuredOutputsParams(json={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                           "required": ["ok"], "additionalProperties": False})]
    params = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=MAX_TOKENS, structured_outputs=s)
              for i, s in enumerate(specs)]
    outputs = llm.generate(["Is the sky blue?"] * len(specs), params, use_tqdm=False)
    for spec, output in zip(specs, outputs):
        for completion in output.outputs:
            if spec is None:
                continue
            assert completion.finish_reason == "stop", completion
            if spec.choice:
                assert completion.text in spec.choice
            elif spec.regex:
                assert re.fullmatch(spec.regex, completion.text)
            else:
                assert isinstance(json.loads(completion.text)["ok"], bool)
