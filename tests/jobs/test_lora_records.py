"""Bulk jobs whose records name their own LoRA adapter ("lora_path"): each record's result is
what LLM.generate gives its prompt with that adapter (itself checked against PEFT in
tests/test_lora.py), and a resume notices a record's adapter changing, by path or in place."""

import pytest

from contbatch import LLM, LoRARequest, SamplingParams
from contbatch.cli import main
from contbatch.jobs import InputMismatch, run_job
from tests.conftest import make_peft_adapter
from tests.jobs.helpers import read_jsonl, results_by_id, write_csv, write_jsonl

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPTS = ["prompt zero", "prompt one", "prompt two", "prompt three"]


@pytest.fixture(scope="module")
def adapter_dirs(chat_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [make_peft_adapter(chat_model_dir, root / f"adapter{i}", i, scale=4.0, r=4,
                              target_modules=["q_proj", "v_proj", "down_proj"]) for i in range(2)]


@pytest.fixture(scope="module")
def lora_llm(chat_model_dir):
    return LLM(chat_model_dir, dtype="float32", enable_lora=True, max_loras=2)


def _expected(llm: LLM, loras: list) -> dict:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    return {f"r{i}": out.outputs[0].text for i, out in enumerate(outputs)}


def _texts(path) -> dict:
    return {record_id: result["outputs"][0]["text"] for record_id, result in results_by_id(path).items()}


def _job(chat_model_dir, llm, source, output, **kwargs):
    return run_job(source, output, model=chat_model_dir, llm=llm, sampling_params=GREEDY, **kwargs)


def test_each_record_runs_with_the_adapter_it_names(chat_model_dir, lora_llm, adapter_dirs, tmp_path):
    names = [str(adapter_dirs[0]), None, str(adapter_dirs[1]), str(adapter_dirs[0])]
    records = [{"id": f"r{i}", "prompt": p, "lora_path": path} for i, (p, path) in enumerate(zip(PROMPTS, names))]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    assert _job(chat_model_dir, lora_llm, source, tmp_path / "out.jsonl").written == 4
    loras = [None if path is None else LoRARequest("x", i + 1, path) for i, path in enumerate(names)]
    loras[3] = loras[0]  # one id for one directory
    assert _texts(tmp_path / "out.jsonl") == _expected(lora_llm, loras)
    assert _texts(tmp_path / "out.jsonl") != _expected(lora_llm, [None] * 4), "the adapters changed nothing"


def test_a_records_adapter_overrides_the_job_wide_one_in_a_csv_file(chat_model_dir, lora_llm, adapter_dirs, tmp_path):
    """An empty lora_path cell is the job's default: its --lora adapter."""
    names = ["", str(adapter_dirs[1]), "", ""]
    source = write_csv(tmp_path / "in.csv", [{"id": f"r{i}", "prompt": p, "lora_path": path}
                                             for i, (p, path) in enumerate(zip(PROMPTS, names))])
    job_wide = LoRARequest("job", 1, str(adapter_dirs[0]))
    _job(chat_model_dir, lora_llm, source, tmp_path / "out.jsonl", lora_request=job_wide)
    own = LoRARequest("own", 2, str(adapter_dirs[1]))
    assert _texts(tmp_path / "out.jsonl") == _expected(lora_llm, [job_wide, own, job_wide, job_wide])


def test_a_resume_refuses_a_records_changed_adapter_and_redoes_it_on_request(
    chat_model_dir, lora_llm, adapter_dirs, tmp_path
):
    """Another directory under the same id, or the same directory retrained in place: both are
    refused naming the id; redo_mismatched generates that record again with the adapter now there."""
    trained = make_peft_adapter(chat_model_dir, tmp_path / "trained", 0, scale=4.0, r=4,
                                target_modules=["q_proj", "v_proj", "down_proj"])
    records = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    records[1]["lora_path"] = str(trained)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    output = tmp_path / "out.jsonl"
    _job(chat_model_dir, lora_llm, source, output)
    assert _job(chat_model_dir, lora_llm, source, output).already_done == 4  # unchanged: nothing to do

    records[2]["lora_path"] = str(adapter_dirs[1])
    write_jsonl(source, records)
    with pytest.raises(InputMismatch, match="first: id 'r2' at input line 3: the sampling settings or LoRA adapter"):
        _job(chat_model_dir, lora_llm, source, output)
    records[2].pop("lora_path")
    write_jsonl(source, records)

    make_peft_adapter(chat_model_dir, trained, 1, scale=4.0, r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    with pytest.raises(InputMismatch, match="first: id 'r1' at input line 2"):
        _job(chat_model_dir, lora_llm, source, output)
    fresh = LLM(chat_model_dir, dtype="float32", enable_lora=True)  # the old adapter stays loaded in lora_llm
    assert _job(chat_model_dir, fresh, source, output, redo_mismatched=True).redone == 1
    retrained = fresh.generate(PROMPTS[1], GREEDY, use_tqdm=False, lora_request=LoRARequest("t", 5, str(trained)))
    assert _texts(output)["r1"] == retrained[0].outputs[0].text


def test_bad_adapters_fail_their_records_only(chat_model_dir, chat_llm, lora_llm, adapter_dirs, tmp_path):
    records = [{"id": "good", "prompt": PROMPTS[0], "lora_path": str(adapter_dirs[0])},
               {"id": "missing", "prompt": PROMPTS[1], "lora_path": str(tmp_path / "nowhere")},
               {"id": "number", "prompt": PROMPTS[2], "lora_path": 7},
               {"id": "blank", "prompt": PROMPTS[3], "lora_path": " "}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    summary = _job(chat_model_dir, lora_llm, source, tmp_path / "out.jsonl")
    assert (summary.written, summary.errors) == (1, 3)
    errors = {e["id"]: e["error"] for e in read_jsonl(tmp_path / "out.jsonl.errors.jsonl")}
    assert "nowhere' is not a directory" in errors["missing"]
    assert errors["number"] == "field 'lora_path' must be a LoRA adapter directory (a string), got int"
    assert errors["blank"].startswith("field 'lora_path' is empty")

    summary = _job(chat_model_dir, chat_llm, source, tmp_path / "base.jsonl")  # an LLM without LoRA
    assert summary.written == 0
    errors = {e["id"]: e["error"] for e in read_jsonl(tmp_path / "base.jsonl.errors.jsonl")}
    assert "this job runs without LoRA: pass --enable-lora" in errors["good"]


def test_the_cli_serves_records_adapters_with_enable_lora(chat_model_dir, lora_llm, adapter_dirs, tmp_path):
    records = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    records[0]["lora_path"] = str(adapter_dirs[1])
    source = write_jsonl(tmp_path / "in.jsonl", records)
    argv = ["generate", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(chat_model_dir),
            "--dtype", "float32", "--temperature", "0", "--max-tokens", "4"]
    assert main([*argv, "--enable-lora", "--max-loras", "2"]) == 0
    expected = _expected(lora_llm, [LoRARequest("a", 20, str(adapter_dirs[1]))] + [None] * 3)
    assert _texts(tmp_path / "out.jsonl") == expected
    with pytest.raises(SystemExit):
        main([*argv, "--max-loras", "2"])  # without LoRA on: a usage error
