"""Fixtures for structured-output tests: the demo model's real tokenizer and a compiler for it."""

import pytest
import torch
from transformers import AutoTokenizer

from contbatch.structured_outputs.grammar import GrammarCompiler

EOS_ID = 2  # <|im_end|>, SmolLM2's EOS
VOCAB_SIZE = 49152


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """These tests make thousands of tiny torch calls; with two intra-op threads on a busy
    2-core machine each one spin-waits, and the suite runs 15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    from contbatch.demo_model import demo_model_dir

    return AutoTokenizer.from_pretrained(demo_model_dir())


@pytest.fixture(scope="session")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB_SIZE, frozenset({EOS_ID}))
