"""Fixtures for the bulk-job tests: a tiny random Llama that has a real tokenizer (text prompts)."""

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from contbatch import LLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


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


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tiny model is fastest on one thread, and two threads crawl when other jobs share the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
