"""The model's own sampling defaults (generation_config.json), as vLLM's generation_config="auto":
prompts given no SamplingParams run with them; "vllm" and explicit SamplingParams do not."""

import json
import shutil

import pytest

from contbatch import LLM, SamplingParams

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "repetition_penalty": 1.1,
               "do_sample": True}


@pytest.fixture
def model_dir(tiny_model_dirs, tmp_path):
    """The tiny Llama with a generation_config.json that recommends sampling settings."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], path)
    settings = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**settings, **RECOMMENDED}))
    return path


def test_prompts_without_params_run_with_the_models_recommended_settings(model_dir):
    llm = LLM(model_dir, skip_tokenizer_init=True)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens, defaults.repetition_penalty) \
        == (0.6, 0.9, 20, 7, 1.1)
    assert defaults.min_p == SamplingParams().min_p  # not in the file: SamplingParams' own
    [output] = llm.generate([[1, 2, 3]], use_tqdm=False)
    completion = output.outputs[0]
    assert (len(completion.token_ids), completion.finish_reason) == (7, "length") or (
        len(completion.token_ids) < 7 and completion.finish_reason == "stop"), "not max_new_tokens' 7"
    explicit = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 3


def test_generation_config_vllm_keeps_sampling_params_defaults(model_dir, tiny_model_dirs):
    assert LLM(model_dir, skip_tokenizer_init=True, generation_config="vllm").get_default_sampling_params() \
        == SamplingParams()
    # The tiny models' own file sets no sampling field: nothing changes for them.
    assert LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True).get_default_sampling_params() == SamplingParams()


def test_bad_settings_are_refused_before_the_weights_load(model_dir, monkeypatch):
    import contbatch.llm

    monkeypatch.setattr(contbatch.llm, "LLMEngine", lambda *a, **k: pytest.fail("the weights loaded first"))
    with pytest.raises(ValueError, match="generation_config must be one of 'auto', 'vllm', got 'hf'"):
        LLM(model_dir, skip_tokenizer_init=True, generation_config="hf")
    (model_dir / "generation_config.json").write_text(json.dumps({**RECOMMENDED, "top_p": 2.0}))
    message = r"generation_config.json': SamplingParams.top_p .*2.0.*generation_config='vllm'"
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, skip_tokenizer_init=True)
