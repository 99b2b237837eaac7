"""contbatch generate: flags, help, exit codes (in process; the subprocess runs are in test_crash.py)."""

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from contbatch import LLM, SamplingParams, ops
from contbatch.cli import build_parser, main
from tests.jobs.helpers import read_jsonl, write_jsonl

EXPLICIT_SAMPLING_FLAGS = [
    "--temperature", "--top-p", "--top-k", "--min-p", "--max-tokens",
    "--min-tokens", "--seed", "--ignore-eos", "--n", "--stop",
]


def _generate_parser():
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "==SUPPRESS==" and a.choices]
    return subparsers.choices["generate"]


def test_help_documents_every_flag_with_examples(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "contbatch generate --input prompts.jsonl" in text
    assert "'-': standard output" in " ".join(text.split()) and "--redo-mismatched" in text
    for flag in EXPLICIT_SAMPLING_FLAGS:
        assert flag in text
    for action in _generate_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_the_contbatch_command_runs_the_entry_point_that_ignores_a_late_ctrl_c():
    # python -m contbatch runs cli.run (tested in test_crash.py); the installed command must too.
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["contbatch"] == "contbatch.cli:run"


def test_every_sampling_field_gets_a_flag_or_a_reason():
    flags = {s for a in _generate_parser()._actions for s in a.option_strings}
    missing = [f.name for f in dataclasses.fields(SamplingParams) if "--" + f.name.replace("_", "-") not in flags]
    assert set(missing) <= {"structured_outputs"}, missing  # free-form objects: JSONL overrides only


def _cli(tmp_path, model_dir, *extra):
    source = tmp_path / "in.jsonl"
    if not source.exists():
        write_jsonl(source, [{"id": i, "prompt": f"prompt {i}"} for i in range(3)])
    return main(["generate", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(model_dir),
                 "--dtype", "float32", "--temperature", "0", "--max-tokens", "3", *extra])


def test_runs_and_prints_one_summary_line(tmp_path, chat_model_dir, capsys):
    assert _cli(tmp_path, chat_model_dir, "--max-num-seqs", "2") == 0
    summary = [line for line in capsys.readouterr().err.splitlines() if "records written" in line]
    assert len(summary) == 1 and "done: 3 records written" in summary[0] and "tok/s" in summary[0]
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "out.jsonl")) == [0, 1, 2]


def test_model_impl_transformers_gives_the_native_results(tmp_path, chat_model_dir):
    native, generic = tmp_path / "native", tmp_path / "generic"
    native.mkdir(), generic.mkdir()
    assert _cli(native, chat_model_dir, "--model-impl", "native") == 0
    assert _cli(generic, chat_model_dir, "--model-impl", "transformers") == 0
    texts = [{r["id"]: r["outputs"][0]["text"] for r in read_jsonl(d / "out.jsonl")} for d in (native, generic)]
    assert texts[0] == texts[1] and len(texts[0]) == 3


@pytest.mark.parametrize("flag, value, field, expected", [("--n", "2", "n", 2), ("--stop", "zz", "stop", ["zz"])])
def test_n_and_stop_pass_through(tmp_path, chat_model_dir, flag, value, field, expected):
    assert _cli(tmp_path, chat_model_dir, flag, value) == 0
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["settings"][f"sampling.{field}"] == expected
    if field == "n":
        assert all(len(r["outputs"]) == 2 for r in read_jsonl(tmp_path / "out.jsonl"))


def test_token_restriction_flags_reach_every_record_and_the_settings(tmp_path, chat_model_dir, chat_llm):
    yes = chat_llm.get_tokenizer().encode(" yes", add_special_tokens=False)[0]
    assert _cli(tmp_path, chat_model_dir, "--logit-bias", json.dumps({str(yes): 100}), "--bad-words", "no",
                "--truncate-prompt-tokens", "2") == 0
    records = read_jsonl(tmp_path / "out.jsonl")
    assert [r["outputs"][0]["text"] for r in records] == [" yes yes yes"] * 3
    assert {r["prompt_tokens"] for r in records} == {2}
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())["settings"]
    assert meta["sampling.logit_bias"] == {str(yes): 100.0} and meta["sampling.bad_words"] == ["no"]
    assert _cli(tmp_path, chat_model_dir, "--logit-bias", json.dumps({str(yes): 50})) == 1, "a resume with another bias"


def test_a_logit_bias_that_is_not_a_json_object_is_a_usage_error(tmp_path, chat_model_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        _cli(tmp_path, chat_model_dir, "--logit-bias", "[1, 2]")
    assert exited.value.code == 2 and "--logit-bias: expected a JSON object" in capsys.readouterr().err


def test_invalid_sampling_value_is_a_usage_error(tmp_path, chat_model_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        _cli(tmp_path, chat_model_dir, "--top-p", "0")
    assert exited.value.code == 2 and "top_p" in capsys.readouterr().err


def test_job_errors_exit_1_with_the_reason(tmp_path, chat_model_dir, capsys):
    assert _cli(tmp_path, chat_model_dir) == 0
    assert _cli(tmp_path, chat_model_dir, "--max-tokens", "4") == 1
    err = capsys.readouterr().err
    assert "contbatch: error: the existing results were made with other settings" in err and "--force" in err
    assert _cli(tmp_path, chat_model_dir, "--max-tokens", "4", "--force") == 0


def test_changed_records_are_refused_then_redone_with_the_flag(tmp_path, chat_model_dir, capsys):
    assert _cli(tmp_path, chat_model_dir) == 0
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"edited prompt {i}"} for i in range(3)])
    assert _cli(tmp_path, chat_model_dir) == 1
    err = capsys.readouterr().err
    assert "contbatch: error:" in err and "first: id 0 at input line 1: the prompt differs" in err
    assert _cli(tmp_path, chat_model_dir, "--redo-mismatched") == 0
    assert "3 records written" in capsys.readouterr().err
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "out.jsonl")) == [0, 1, 2]


def test_ctrl_c_after_the_job_wound_up_still_exits_130(tmp_path, chat_model_dir, capsys, monkeypatch):
    """A second Ctrl-C can land after generation restored the default handler, e.g. while the
    summary prints: an exit status 130 and one line, not a traceback and 1."""
    from contbatch.jobs.runner import JobSummary

    def interrupted_while_printing(self) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(JobSummary, "line", interrupted_while_printing)
    assert _cli(tmp_path, chat_model_dir) == 130
    err = capsys.readouterr().err
    assert "contbatch: interrupted; rerun the same command to carry on" in err and "Traceback" not in err
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 3


def test_without_model_the_demo_model_is_used(tmp_path, chat_model_dir, monkeypatch):
    import contbatch.demo_model

    monkeypatch.setattr(contbatch.demo_model, "demo_model_dir", lambda: chat_model_dir)
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    files = ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert main(["generate", *files, "--dtype", "float32", "--max-tokens", "2"]) == 0
    assert json.loads((tmp_path / "out.jsonl.meta.json").read_text())["model_path"] == str(chat_model_dir.resolve())


# How a job's settings name narrow weights, where the int8 kernel takes them (ops.int8_weight_qmax).
NARROW = "" if ops.int8_weight_qmax() == 127 else f", the layers but the LM head within +-{ops.int8_weight_qmax()}"


@pytest.mark.parametrize(
    ("flags", "llm_kwargs", "setting", "value"),
    [
        (["--quantization", "int8"], dict(quantization="int8"), "engine.quantization",
         f"int8 in {ops.int8_weight_block()}-input blocks{NARROW}, LM head int8, embeddings dense"),
        (["--kv-cache-dtype", "int8"], dict(kv_cache_dtype="int8"), "engine.kv_cache_dtype", "int8"),
    ],
)
def test_an_int8_job_gives_llm_results_and_its_settings_guard_a_resume(
    flags, llm_kwargs, setting, value, tmp_path, chat_model_dir, capsys
):
    assert _cli(tmp_path, chat_model_dir, *flags) == 0
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["settings"][setting] == value
    llm = LLM(chat_model_dir, dtype="float32", **llm_kwargs)
    expected = llm.generate([f"prompt {i}" for i in range(3)], SamplingParams(temperature=0, max_tokens=3),
                            use_tqdm=False)  # fmt: skip
    texts = {r["id"]: r["outputs"][0]["text"] for r in read_jsonl(tmp_path / "out.jsonl")}
    assert texts == {i: out.outputs[0].text for i, out in enumerate(expected)}
    assert _cli(tmp_path, chat_model_dir) == 1, "results without the setting must not be mixed in"
    err = capsys.readouterr().err
    assert "made with other settings" in err and setting in err


def test_a_lora_job_gives_the_adapters_results_and_a_resume_with_another_adapter_is_refused(
    tmp_path, chat_model_dir, capsys
):
    from contbatch import LoRARequest
    from tests.conftest import make_peft_adapter

    adapters = [make_peft_adapter(chat_model_dir, tmp_path / f"adapter{i}", i, r=4,
                                  target_modules=["q_proj", "v_proj", "down_proj"]) for i in range(2)]
    assert _cli(tmp_path, chat_model_dir, "--lora", str(adapters[0]), "--max-lora-rank", "8") == 0
    llm = LLM(chat_model_dir, dtype="float32", enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=3)
    prompts = [f"prompt {i}" for i in range(3)]
    expected = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapters[0])))
    base = llm.generate(prompts, params, use_tqdm=False)
    texts = {r["id"]: r["outputs"][0]["text"] for r in read_jsonl(tmp_path / "out.jsonl")}
    assert texts == {i: out.outputs[0].text for i, out in enumerate(expected)}
    assert texts != {i: out.outputs[0].text for i, out in enumerate(base)}
    capsys.readouterr()
    assert _cli(tmp_path, chat_model_dir, "--lora", str(adapters[1])) == 1
    err = capsys.readouterr().err
    assert "made with other settings" in err and "engine.lora_adapter" in err
    with pytest.raises(SystemExit):
        _cli(tmp_path, chat_model_dir, "--max-lora-rank", "8")  # without --lora: a usage error
