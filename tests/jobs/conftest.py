"""Fixtures for the bulk-job tests: an LLM of tests/conftest.py's tiny chat model (a real
tokenizer, for text prompts) and run_job into a temporary directory with it."""

import pytest
import torch

from contbatch import LLM, SamplingParams
from contbatch.jobs import run_job

GREEDY = SamplingParams(temperature=0, max_tokens=4)


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
