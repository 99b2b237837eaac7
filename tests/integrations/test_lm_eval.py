"""contbatch as an lm-eval backend, checked against lm-eval's own ``hf`` backend.

Both backends run the same local tasks (tests/integrations/lm_eval_tasks: multiple choice,
greedy generation with stop strings, rolling perplexity) on SmolLM2-135M in fp32 with
max_length=64, so that documents span several rolling windows. Per-sample log-likelihoods,
is_greedy flags, generated texts and the aggregate metrics must agree.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

import contbatch.integrations.lm_eval  # noqa: E402,F401  (registers the "contbatch" model)

REPO_ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO_ROOT / "tests" / "integrations" / "lm_eval_tasks"
TASKS = ["contbatch_mc", "contbatch_gen", "contbatch_ppl"]
MAX_LENGTH = 64
ATOL = 1e-4


def _evaluate(model: str, model_args: str, tasks: list[str], **kwargs) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        log_samples=True,
        **kwargs,
    )


@pytest.fixture(scope="module")
def offline_datasets(tmp_path_factory):
    """Task data from the repo's JSONL files, run from the repo root, nothing from a hub."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_ROOT)
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def both_backends(offline_datasets, smollm_dir) -> tuple[dict, dict]:
    common = f"pretrained={smollm_dir},dtype=float32,max_length={MAX_LENGTH}"
    theirs = _evaluate("hf", f"{common},device=cpu", TASKS, batch_size=1)
    ours = _evaluate("contbatch", common, TASKS)
    return ours, theirs


def _samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def test_multiple_choice_loglikelihoods_and_greedy_flags_match_hf(both_backends):
    ours, theirs = both_backends
    our_samples, their_samples = _samples(ours, "contbatch_mc"), _samples(theirs, "contbatch_mc")
    assert len(our_samples) == len(their_samples) == 16
    for mine, reference in zip(our_samples, their_samples):
        assert [r[0] for r in mine["resps"]] != []
        for (ll, greedy), (ref_ll, ref_greedy) in zip(
            (r[0] for r in mine["resps"]), (r[0] for r in reference["resps"]), strict=True
        ):
            assert ll == pytest.approx(ref_ll, abs=ATOL), mine["doc_id"]
            assert greedy == ref_greedy, mine["doc_id"]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["contbatch_mc"][metric] == theirs["results"]["contbatch_mc"][metric]


def test_generate_until_texts_match_hf(both_backends):
    ours, theirs = both_backends
    our_texts = [s["resps"][0][0] for s in _samples(ours, "contbatch_gen")]
    their_texts = [s["resps"][0][0] for s in _samples(theirs, "contbatch_gen")]
    assert len(our_texts) == 12
    assert our_texts == their_texts
    assert all("\n" not in text and "Question:" not in text for text in our_texts)  # cut at `until`
    assert any(text.strip() for text in our_texts)
    metric = "exact_match,none"
    assert ours["results"]["contbatch_gen"][metric] == theirs["results"]["contbatch_gen"][metric]


def test_rolling_loglikelihoods_match_hf_over_several_windows(both_backends, smollm_dir):
    from transformers import AutoTokenizer

    ours, theirs = both_backends
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    our_samples, their_samples = _samples(ours, "contbatch_ppl"), _samples(theirs, "contbatch_ppl")
    lengths = [len(tokenizer.encode(s["doc"]["text"])) for s in our_samples]
    assert max(lengths) > 3 * MAX_LENGTH  # the longest document really spans several windows
    for mine, reference in zip(our_samples, their_samples, strict=True):
        ll, ref_ll = mine["resps"][0][0], reference["resps"][0][0]
        assert ll < 0
        assert ll == pytest.approx(ref_ll, rel=1e-4)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["contbatch_ppl"][metric] == pytest.approx(theirs["results"]["contbatch_ppl"][metric], rel=1e-4)


def test_chat_template_generation_matches_hf(offline_datasets, smollm_dir):
    common = f"pretrained={smollm_dir},dtype=float32,max_length=256"
    kwargs = dict(apply_chat_template=True, limit=4)
    theirs = _evaluate("hf", f"{common},device=cpu", ["contbatch_gen"], batch_size=1, **kwargs)
    ours = _evaluate("contbatch", common, ["contbatch_gen"], **kwargs)
    our_samples, their_samples = _samples(ours, "contbatch_gen"), _samples(theirs, "contbatch_gen")
    assert "<|im_start|>" in our_samples[0]["arguments"][0][0]  # the prompt really went through the template
    assert [s["resps"][0][0] for s in our_samples] == [s["resps"][0][0] for s in their_samples]


def test_unknown_generation_kwarg_is_refused_by_name(smollm_dir):
    model = lm_eval.api.registry.get_model("contbatch")(pretrained=str(smollm_dir), dtype="float32", max_length=64)
    with pytest.raises(ValueError, match="num_beams"):
        model._sampling_params({"until": ["\n"], "num_beams": 4}, eos="</s>")


def test_contbatch_eval_command_runs_lm_eval_cli(offline_datasets, smollm_dir, tmp_path):
    command = [
        sys.executable, "-m", "contbatch", "eval",
        "--model_args", f"pretrained={smollm_dir},dtype=float32,max_length={MAX_LENGTH}",
        "--tasks", "contbatch_mc", "--include_path", str(TASKS_DIR), "--limit", "4",
        "--output_path", str(tmp_path / "results"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = list((tmp_path / "results").rglob("results_*.json"))
    assert len(written) == 1
    results = json.loads(written[0].read_text())
    assert results["config"]["model"] == "contbatch"
    accuracy = results["results"]["contbatch_mc"]["acc,none"]
    assert not math.isnan(accuracy) and 0.0 <= accuracy <= 1.0


def test_lora_adapter_scores_match_hf_with_peft(offline_datasets, smollm_dir, tmp_path):
    """``lora_local_path`` (the vllm backend's name) against the hf backend's ``peft``: the same
    PEFT adapter, the same per-sample log-likelihoods and texts, and not the base model's."""
    from tests.conftest import make_peft_adapter

    adapter = make_peft_adapter(smollm_dir, tmp_path / "adapter", 0, scale=0.5, r=8, lora_alpha=16,
                                target_modules=["q_proj", "v_proj", "down_proj"])
    common = f"pretrained={smollm_dir},dtype=float32,max_length={MAX_LENGTH}"
    tasks, kwargs = ["contbatch_mc", "contbatch_gen"], dict(limit=6)
    theirs = _evaluate("hf", f"{common},device=cpu,peft={adapter}", tasks, batch_size=1, **kwargs)
    ours = _evaluate("contbatch", f"{common},lora_local_path={adapter}", tasks, **kwargs)
    base = _evaluate("contbatch", common, ["contbatch_mc"], **kwargs)
    lls = {name: [r[0][0] for s in _samples(result, "contbatch_mc") for r in s["resps"]]
           for name, result in (("ours", ours), ("theirs", theirs), ("base", base))}
    assert lls["ours"] == pytest.approx(lls["theirs"], abs=ATOL)
    assert lls["ours"] != pytest.approx(lls["base"], abs=1e-2)  # the adapter changed the scores
    assert [s["resps"][0][0] for s in _samples(ours, "contbatch_gen")] == \
        [s["resps"][0][0] for s in _samples(theirs, "contbatch_gen")]
