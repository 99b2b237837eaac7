"""The transformers path (contbatch/models/transformers_backend.py): transformers' own modeling
code on contbatch's paged KV cache.

Tiny random fp32 models of eight architectures (seven with no native model, and Gemma 3, whose
native module is tested in test_native_phi3_gemma3.py), on this path, each request's greedy
tokens equal to HF `generate` on it alone while the requests run together (the oracle
scenarios of tests/test_generate_oracle.py: mixed batches with prefix hits, preemption,
chunked prefill), and their logprobs equal to HF's (the heads differ after the LM head, and
greedy tokens would not show it). Llama on this path gives the native path's tokens, and
every engine feature (sampling with n > 1, logprobs, prompt logprobs, stop strings,
penalties, structured outputs) gives the same outputs on both. Architectures neither path
can run, and bad model_impl values, are refused before any work.
"""

import logging
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    CohereConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    Llama4TextConfig,
    Olmo2Config,
    PhiConfig,
    Qwen2Config,
    SmolLM3Config,
    StableLmConfig,
    ViTConfig,
)

from contbatch import LLM, SamplingParams
from contbatch.models.config import ModelConfig
from contbatch.models.transformers_config import TransformersModelConfig
from tests.conftest import TINY_CONFIGS, TINY_VOCAB, HFOracle, assert_greedy_match, save_random_model
from tests.ops.paged_batch import device_params
from tests.test_generate_oracle import (
    EOS,
    NEAR_TIE_TOL,
    SCENARIOS,
    _check_scenario,
    _engine_kwargs,
    _run_and_spy,
    _tiny_prompts,
)

LOGPROB_TOL = 1e-4  # fp32 log-softmax of the same logits, summed in another order

_SIZES = dict(vocab_size=TINY_VOCAB, max_position_embeddings=512, initializer_range=0.2,
              bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
_GQA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
_MHA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)

# What each one brings that the native Llama family does not.
GENERIC_CONFIGS = {
    # GPT-2 names (n_embd, n_head, n_layer), learned positions, Conv1D, per-layer attention scale.
    "gpt2": lambda: GPT2Config(n_embd=128, n_head=2, n_layer=2, n_positions=512, vocab_size=TINY_VOCAB,
                               initializer_range=0.2, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                               scale_attn_by_inverse_layer_idx=True),
    # Partial rotary, parallel residual, an `embed_out` head.
    "gpt-neox": lambda: GPTNeoXConfig(**_SIZES, **_MHA, partial_rotary_factor=0.25),
    # Phi-2 style: partial rotary, q/k LayerNorm, a biased LM head.
    "phi": lambda: PhiConfig(**_SIZES, **_MHA, partial_rotary_factor=0.5, qk_layernorm=True),
    # Attention scale other than head_dim**-0.5; logits divided by logits_scaling.
    "granite": lambda: GraniteConfig(**_SIZES, **_GQA, attention_multiplier=0.05, logits_scaling=4.0,
                                     embedding_multiplier=3.0, residual_multiplier=0.5),
    # q/k RMSNorm over whole projections.
    "olmo2": lambda: Olmo2Config(**_SIZES, **_GQA),
    # Layers without rotary embeddings (NoPE).
    "smollm3": lambda: SmolLM3Config(**_SIZES, **_GQA, no_rope_layer_interval=2),
    # A sliding-window layer and a full one; query_pre_attn_scalar; softcapped logits.
    "gemma3": lambda: Gemma3TextConfig(**_SIZES, **_GQA, head_dim=64, sliding_window=8, query_pre_attn_scalar=48,
                                       layer_types=["sliding_attention", "full_attention"],
                                       final_logit_softcapping=20.0),
    # Parallel attention and MLP, q/k LayerNorm, logits times logit_scale.
    "cohere": lambda: CohereConfig(**_SIZES, **_GQA, logit_scale=0.5, use_qk_norm=True),
}


@pytest.fixture(scope="module")
def generic_model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {
        name: save_random_model(make_config(), tmp_path_factory.mktemp(name), seed=len(name))
        for name, make_config in GENERIC_CONFIGS.items()
    }


@pytest.fixture(scope="module")
def generic_oracle_outputs(generic_model_dirs) -> dict[str, list[list[int]]]:
    prompts, max_tokens = _tiny_prompts()
    return {
        arch: [HFOracle(path).greedy(p, n, EOS) for p, n in zip(prompts, max_tokens)]
        for arch, path in generic_model_dirs.items()
    }


def _greedy_outputs(llm: LLM, scenario_name: str) -> tuple[list[list[int]], list[list[int]]]:
    """The oracle scenario run on ``llm``: (prompts, generated token ids), after its checks."""
    prompts, max_tokens = _tiny_prompts()
    outputs, seen = _run_and_spy(llm, prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])
    _check_scenario(llm, scenario_name, seen, outputs)
    return prompts, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("scenario_name", SCENARIOS)
@pytest.mark.parametrize("arch", GENERIC_CONFIGS)
def test_generic_models_match_hf(arch, scenario_name, device, generic_model_dirs, generic_oracle_outputs):
    model_dir = generic_model_dirs[arch]
    llm = LLM(model_dir, skip_tokenizer_init=True, model_impl="transformers",
              **_engine_kwargs(model_dir, SCENARIOS[scenario_name], 192, device))
    assert isinstance(llm.engine.model_config, TransformersModelConfig)
    prompts, ours = _greedy_outputs(llm, scenario_name)
    oracle = None
    for prompt, tokens, expected in zip(prompts, ours, generic_oracle_outputs[arch]):
        if tokens != expected:
            oracle = oracle or HFOracle(model_dir)
            assert_greedy_match(oracle, prompt, tokens, expected, NEAR_TIE_TOL)


@pytest.mark.parametrize("arch", GENERIC_CONFIGS)
def test_generic_logprobs_match_hf(arch, generic_model_dirs):
    """Sampled and prompt logprobs are HF's log-softmax: the model's own head code ran."""
    prompt, _ = _tiny_prompts()
    prompt = prompt[0]
    llm = LLM(generic_model_dirs[arch], skip_tokenizer_init=True, dtype="float32", max_model_len=192,
              model_impl="transformers")
    assert isinstance(llm.engine.model_config, TransformersModelConfig)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=2)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    generated = output.outputs[0].token_ids
    tokens = prompt + generated
    with torch.inference_mode():
        hf = HFOracle(generic_model_dirs[arch]).model
        expected = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)
    ours = output.prompt_logprobs[1:] + output.outputs[0].logprobs  # entry i scores token i + 1
    assert len(ours) == len(tokens) - 1
    for position, entry in enumerate(ours):
        token = tokens[position + 1]
        assert abs(entry[token].logprob - float(expected[position, token])) < LOGPROB_TOL, (position, token)


@pytest.mark.parametrize("scenario_name", SCENARIOS)
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_native_architectures_on_the_generic_path_match_native(arch, scenario_name, tiny_model_dirs):
    """Same tokens from transformers' Llama/Mistral/Qwen code as from contbatch's own model."""
    model_dir = tiny_model_dirs[arch]
    kwargs = _engine_kwargs(model_dir, SCENARIOS[scenario_name], 192)
    native = LLM(model_dir, skip_tokenizer_init=True, model_impl="native", **kwargs)
    generic = LLM(model_dir, skip_tokenizer_init=True, model_impl="transformers", **kwargs)
    assert isinstance(native.engine.model_config, ModelConfig)
    assert isinstance(generic.engine.model_config, TransformersModelConfig)
    prompts, native_tokens = _greedy_outputs(native, scenario_name)
    _, generic_tokens = _greedy_outputs(generic, scenario_name)
    oracle = None
    for prompt, theirs, ours in zip(prompts, native_tokens, generic_tokens):
        if ours != theirs:  # fused and separate projections round differently: only a near-tie may flip
            oracle = oracle or HFOracle(model_dir)
            assert_greedy_match(oracle, prompt, ours, theirs, NEAR_TIE_TOL)


def test_every_engine_feature_gives_the_same_outputs_on_both_paths(chat_model_dir):
    """A random Llama with SmolLM2's tokenizer: each path's outputs, feature by feature."""
    prompts = ["Tell me a story.", "What is the capital of France?", "Yes or no?", "List three colours"]
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0, max_tokens=10, logprobs=1, prompt_logprobs=2),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs={"choice": ["yes", "no", "maybe"]}),
        SamplingParams(temperature=0.7, seed=5, max_tokens=16, presence_penalty=0.5, stop=[" the"]),
    ]
    runs = {}
    for impl in ("native", "transformers"):
        llm = LLM(chat_model_dir, dtype="float32", max_model_len=256, model_impl=impl)
        runs[impl] = llm.generate(prompts, params, use_tqdm=False)
    assert runs["transformers"][2].outputs[0].text in ("yes", "no", "maybe")
    for native, generic in zip(runs["native"], runs["transformers"]):
        assert len(generic.outputs) == len(native.outputs)
        for theirs, ours in zip(native.outputs, generic.outputs):
            assert ours.token_ids == theirs.token_ids
            assert (ours.text, ours.finish_reason) == (theirs.text, theirs.finish_reason)
            _assert_logprobs_close(ours.logprobs, theirs.logprobs)
        _assert_logprobs_close(generic.prompt_logprobs, native.prompt_logprobs)


def _assert_logprobs_close(ours: list | None, theirs: list | None) -> None:
    assert (ours is None) == (theirs is None)
    for our_entry, their_entry in zip(ours or [], theirs or []):
        assert (our_entry is None) == (their_entry is None)
        if our_entry is not None:
            assert our_entry.keys() == their_entry.keys()
            for token, logprob in our_entry.items():
                assert abs(logprob.logprob - their_entry[token].logprob) < LOGPROB_TOL


def _config_only_dir(config, architecture: str | None, path: Path) -> Path:
    """config.json alone: a refusal that names the model proves no weights were read."""
    config.architectures = [architecture] if architecture else None
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("make_config", "architecture", "match"),
    [
        (BertConfig, "BertForMaskedLM", "BertForMaskedLM is not a causal language model"),
        (ViTConfig, "ViTForImageClassification", "ViTForImageClassification is not a causal language model"),
        (ViTConfig, None, "vit: transformers has no causal-LM class for model_type 'vit'"),
        (Gemma3Config, "Gemma3ForConditionalGeneration", "Gemma3ForConditionalGeneration is a multimodal model"),
        (Gemma2Config, "Gemma2ForCausalLM", r"Gemma2ForCausalLM needs attention softcapping"),
        (lambda: FalconConfig(alibi=True), "FalconForCausalLM", "FalconForCausalLM needs ALiBi"),
        (Llama4TextConfig, "Llama4ForCausalLM", r"Llama4ForCausalLM needs chunked attention"),
        (StableLmConfig, "StableLmForCausalLM", "does not pass attention arguments through"),
    ],
)
def test_architectures_neither_path_runs_are_refused_before_any_work(make_config, architecture, match, tmp_path):
    model_dir = _config_only_dir(make_config(), architecture, tmp_path)
    with pytest.raises(ValueError, match=match) as refused:
        LLM(model_dir, skip_tokenizer_init=True)
    assert "native models cannot run it either" in str(refused.value)


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"], "model_type": "foo"}')
    with pytest.raises(ValueError, match="FooForCausalLM: transformers cannot read"):
        LLM(tmp_path, skip_tokenizer_init=True)


def test_attention_sinks_are_refused_at_load(tmp_path):
    """gpt-oss passes its sinks to attention only at call time: the one-token trial at load finds them."""
    config = GptOssConfig(**_SIZES, **_GQA, head_dim=32, num_local_experts=2, num_experts_per_tok=1, sliding_window=24)
    model_dir = save_random_model(config, tmp_path, seed=0)
    with pytest.raises(ValueError, match="GptOssForCausalLM cannot run.*needs attention sinks"):
        LLM(model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=64)


@pytest.mark.parametrize("model_impl", ["vllm", "", None, "Transformers"])
def test_invalid_model_impl_names_the_allowed_values(model_impl, tiny_model_dirs):
    with pytest.raises(ValueError, match="model_impl must be one of 'auto', 'native', 'transformers'"):
        LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, model_impl=model_impl)


def test_native_impl_refuses_an_architecture_without_a_native_model(generic_model_dirs):
    refusal = r"no native model for architecture \['GPT2LMHeadModel'\].*model_impl='native'"
    with pytest.raises(ValueError, match=refusal):
        LLM(generic_model_dirs["gpt2"], skip_tokenizer_init=True, model_impl="native")


def test_auto_takes_native_where_it_can_and_logs_the_path(tiny_model_dirs, generic_model_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="contbatch.models.loader"):
        native = LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="float32")
        generic = LLM(generic_model_dirs["gpt2"], skip_tokenizer_init=True, dtype="float32")
    assert isinstance(native.engine.model_config, ModelConfig)
    assert isinstance(generic.engine.model_config, TransformersModelConfig)
    messages = [record.getMessage() for record in caplog.records]
    assert "LlamaForCausalLM: running contbatch's native model" in messages
    assert any(m.startswith("GPT2LMHeadModel: running transformers' modeling code") for m in messages)


def test_auto_falls_back_when_the_native_model_lacks_a_feature(tmp_path):
    """A Qwen2 config with per-layer sliding windows: native refuses it, transformers' code runs it."""
    config = Qwen2Config(**_SIZES, **_GQA, use_sliding_window=True, sliding_window=24, max_window_layers=1)
    model_dir = save_random_model(config, tmp_path, seed=3)
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        LLM(model_dir, skip_tokenizer_init=True, model_impl="native")
    llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=192)
    assert llm.engine.model_config.sliding_windows == (-1, 24)
    prompts, max_tokens = _tiny_prompts()
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens], use_tqdm=False)
    oracle = HFOracle(model_dir)
    for prompt, n, output in zip(prompts, max_tokens, outputs):
        assert_greedy_match(oracle, prompt, output.outputs[0].token_ids, oracle.greedy(prompt, n, EOS), NEAR_TIE_TOL)
