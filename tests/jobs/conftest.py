"""Fixtures for the bulk-job tests: a tiny random Llama that has a real tokenizer (text prompts)."""

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from contbatch import LLM, SamplingParams
from contbatch.jobs import run_job

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, smollm_dir) -> Path:
    """Random 2-layer Llama (head_dim 64, fp32) with SmolLM2's tokenizer and chat template."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("chat-model")
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).exists():
            shutil.copy(smollm_dir / name, path)
    return path


@pytest.fixture(scope="session")
def chat_llm(chat_model_dir) -> LLM:
    return LLM(chat_model_dir, dtype="float32")


@pytest.fixture
def run(tmp_path, chat_model_dir, chat_llm):
    """run(source, output="out.jsonl", **kwargs): run_job into tmp_path/output with the tiny model, greedy."""

    def run_into(source, output="out.jsonl", **kwargs):
        kwargs = dict(model=chat_model_dir, llm=chat_llm, sampling_params=GREEDY) | kwargs
        return run_job(source, tmp_path / output, **kwargs)

    return run_into


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a job loads a model: for refusals that must come first (give the job llm=None)."""

    def load(*args, **kwargs):
        pytest.fail("the job loaded the model before refusing")

    monkeypatch.setattr("contbatch.jobs.runner.LLM", load)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model is fastest on one thread, and two threads crawl when other jobs share the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
