"""Bulk jobs run with the model's own sampling defaults (its generation_config.json), as LLM.generate
does and vLLM's generation_config="auto": flags and dict overrides go over them, a SamplingParams
replaces them, and generation_config="vllm" keeps SamplingParams()'s."""

import json

from contbatch import LLM, SamplingParams
from contbatch.cli import main
from contbatch.jobs import run_job
from tests.jobs.helpers import read_jsonl, write_jsonl


def _source(tmp_path):
    source = tmp_path / "in.jsonl"
    write_jsonl(source, [{"id": i, "prompt": f"prompt {i}"} for i in range(3)])
    return source


def _settings(output) -> dict:
    return json.loads(output.with_name(output.name + ".meta.json").read_text())["settings"]


def test_cli_flags_not_given_take_the_models_recommended_settings(tmp_path, recommending_chat_model_dir):
    source = _source(tmp_path)

    def generate(name: str, *flags: str):
        output = tmp_path / name
        assert main(["generate", "-i", str(source), "-o", str(output), "-m", str(recommending_chat_model_dir),
                     "--dtype", "float32", "--ignore-eos", *flags]) == 0
        return _settings(output), read_jsonl(output)

    settings, records = generate("auto.jsonl", "--top-k", "3")
    assert (settings["sampling.temperature"], settings["sampling.top_k"], settings["sampling.max_tokens"]) == (0.6, 3, 2)
    assert {r["completion_tokens"] for r in records} == {2}
    settings, records = generate("vllm.jsonl", "--generation-config", "vllm")
    defaults = SamplingParams()
    assert (settings["sampling.temperature"], settings["sampling.top_k"], settings["sampling.max_tokens"]) \
        == (defaults.temperature, defaults.top_k, defaults.max_tokens)
    assert {r["completion_tokens"] for r in records} == {defaults.max_tokens}


def test_run_job_dicts_go_over_the_models_defaults_and_sampling_params_replace_them(
    tmp_path, recommending_chat_model_dir
):
    source, model = _source(tmp_path), recommending_chat_model_dir
    run_job(source, tmp_path / "dict.jsonl", model=model, sampling_params={"ignore_eos": True})
    settings = _settings(tmp_path / "dict.jsonl")
    assert (settings["sampling.temperature"], settings["sampling.max_tokens"], settings["sampling.ignore_eos"]) \
        == (0.6, 2, True)
    assert {r["completion_tokens"] for r in read_jsonl(tmp_path / "dict.jsonl")} == {2}
    run_job(source, tmp_path / "whole.jsonl", model=model, sampling_params=SamplingParams(max_tokens=3))
    assert _settings(tmp_path / "whole.jsonl")["sampling.temperature"] == SamplingParams().temperature
    # A given LLM's defaults are the job's: here it ignores the file.
    llm = LLM(model, dtype="float32", generation_config="vllm")
    run_job(source, tmp_path / "llm.jsonl", model=model, llm=llm)
    assert _settings(tmp_path / "llm.jsonl")["sampling.max_tokens"] == SamplingParams().max_tokens
