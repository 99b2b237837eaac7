"""Native Phi-3 (LongRoPE, partial rotary, sliding window, fused checkpoint projections) and
Gemma 3 text (per-layer windows and rope bases, (1 + w) norms, GeGLU, scaled embeddings,
softcapped logits): tiny random fp32 models of tests/conftest.py's TINY_PHI3_GEMMA3_CONFIGS.

Each request's greedy tokens equal HF `generate` on it alone while the requests run together
(the oracle scenarios of tests/test_generate_oracle.py: mixed batches with prefix hits,
preemption, chunked prefill); logprobs equal HF's log-softmax (softcapping and scales do not
show in greedy tokens); the native path gives the transformers path's tokens; configs
as checkpoints ship them (transformers 4.x names) parse to the same model.

LongRoPE: the factors are chosen once, by max_model_len (contbatch/layers/rotary.py). Above
the original context every token takes the long factors: prompts longer than it are
checked against plain HF, shorter ones against HF held to the long factors. At or below it
every token takes the short factors, as plain HF does for sequences that stay within it.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from contbatch import LLM, SamplingParams
from contbatch.layers.rotary import RotaryEmbedding
from contbatch.models.config import ModelConfig, load_model_config
from contbatch.models.loader import ARCHITECTURES
from tests.conftest import PHI3_ORIGINAL_CONTEXT, HFOracle, assert_greedy_match
from tests.models.test_transformers_backend import LOGPROB_TOL, _greedy_outputs
from tests.test_generate_oracle import EOS, NEAR_TIE_TOL, SCENARIOS, _engine_kwargs, _tiny_prompts

MAX_MODEL_LEN = 192
EXACT_EVERYWHERE = ["gemma3", "phi4-mini-partial"]  # no LongRoPE switch within MAX_MODEL_LEN


def _long_factor_oracle(model_dir: Path) -> HFOracle:
    """HF with the long factors at every length: what contbatch runs above the original context."""
    oracle = HFOracle(model_dir)
    rotary = oracle.model.model.rotary_emb
    original = oracle.model.config.rope_parameters["original_max_position_embeddings"]
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](oracle.model.config, "cpu", seq_len=original + 1)
    rotary.original_inv_freq.copy_(long_inv_freq)  # the set transformers takes for short sequences
    rotary.inv_freq.copy_(long_inv_freq)
    return oracle


@pytest.fixture(scope="module")
def oracles(phi3_gemma3_model_dirs) -> dict[str, list[HFOracle]]:
    """arch -> the HF oracle of each prompt of _tiny_prompts()."""
    prompts, _ = _tiny_prompts()
    result = {arch: [HFOracle(phi3_gemma3_model_dirs[arch])] * len(prompts) for arch in EXACT_EVERYWHERE}
    phi3_dir = phi3_gemma3_model_dirs["phi3-longrope"]
    plain, held_long = HFOracle(phi3_dir), _long_factor_oracle(phi3_dir)
    result["phi3-longrope"] = [plain if len(p) > PHI3_ORIGINAL_CONTEXT else held_long for p in prompts]
    return result


@pytest.fixture(scope="module")
def expected_tokens(oracles) -> dict[str, list[list[int]]]:
    prompts, max_tokens = _tiny_prompts()
    return {
        arch: [oracle.greedy(p, n, EOS) for oracle, p, n in zip(per_prompt, prompts, max_tokens)]
        for arch, per_prompt in oracles.items()
    }


def test_prompts_cross_the_original_context():
    prompts, _ = _tiny_prompts()
    longer = sum(len(p) > PHI3_ORIGINAL_CONTEXT for p in prompts)
    assert 0 < longer < len(prompts)


@pytest.mark.parametrize("scenario_name", SCENARIOS)
@pytest.mark.parametrize("arch", [*EXACT_EVERYWHERE, "phi3-longrope"])
def test_native_models_match_hf(arch, scenario_name, phi3_gemma3_model_dirs, oracles, expected_tokens):
    model_dir = phi3_gemma3_model_dirs[arch]
    llm = LLM(model_dir, skip_tokenizer_init=True, **_engine_kwargs(model_dir, SCENARIOS[scenario_name], MAX_MODEL_LEN))
    assert isinstance(llm.engine.model_config, ModelConfig)  # "auto" took the native model
    prompts, ours = _greedy_outputs(llm, scenario_name)
    for oracle, prompt, tokens, theirs in zip(oracles[arch], prompts, ours, expected_tokens[arch]):
        assert_greedy_match(oracle, prompt, tokens, theirs, NEAR_TIE_TOL)


def test_phi3_within_the_original_context_takes_the_short_factors(phi3_gemma3_model_dirs):
    """max_model_len = original_max_position_embeddings: plain HF, sequences within it."""
    model_dir = phi3_gemma3_model_dirs["phi3-longrope"]
    prompts, max_tokens = _tiny_prompts()
    prompts, max_tokens = [p[:20] for p in prompts], [min(n, PHI3_ORIGINAL_CONTEXT - 20) for n in max_tokens]
    llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=PHI3_ORIGINAL_CONTEXT, max_num_seqs=6)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens], use_tqdm=False)
    assert llm.engine.stats.num_prefix_hit_tokens > 0
    oracle = HFOracle(model_dir)
    for prompt, n, output in zip(prompts, max_tokens, outputs):
        assert_greedy_match(oracle, prompt, output.outputs[0].token_ids, oracle.greedy(prompt, n, EOS), NEAR_TIE_TOL)


@pytest.mark.parametrize("arch", ["gemma3", "phi4-mini-partial", "phi3-longrope"])
def test_logprobs_match_hf(arch, phi3_gemma3_model_dirs):
    """Prompt and sampled logprobs of a prompt longer than Phi-3's original context."""
    prompt = _tiny_prompts()[0][0]
    assert len(prompt) > PHI3_ORIGINAL_CONTEXT
    model_dir = phi3_gemma3_model_dirs[arch]
    llm = LLM(model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, prompt_logprobs=1)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    tokens = prompt + output.outputs[0].token_ids
    with torch.inference_mode():
        logits = HFOracle(model_dir).model(torch.tensor([tokens])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    scored = output.prompt_logprobs[1:] + output.outputs[0].logprobs  # entry i scores token i + 1
    ours = torch.tensor([entry[token].logprob for entry, token in zip(scored, tokens[1:])])
    torch.testing.assert_close(ours, expected, rtol=0, atol=LOGPROB_TOL)


@pytest.mark.parametrize("scenario_name", SCENARIOS)
@pytest.mark.parametrize("arch", EXACT_EVERYWHERE)
def test_native_matches_the_transformers_path(arch, scenario_name, phi3_gemma3_model_dirs):
    """Not phi3-longrope: on transformers' path its factors switch with the batch's longest position."""
    model_dir = phi3_gemma3_model_dirs[arch]
    kwargs = _engine_kwargs(model_dir, SCENARIOS[scenario_name], MAX_MODEL_LEN)
    prompts, native = _greedy_outputs(LLM(model_dir, skip_tokenizer_init=True, model_impl="native", **kwargs),
                                      scenario_name)
    _, generic = _greedy_outputs(LLM(model_dir, skip_tokenizer_init=True, model_impl="transformers", **kwargs),
                                 scenario_name)
    oracle = None
    for prompt, theirs, ours in zip(prompts, generic, native):
        if ours != theirs:  # fused and separate projections round differently: only a near-tie may flip
            oracle = oracle or HFOracle(model_dir)
            assert_greedy_match(oracle, prompt, ours, theirs, NEAR_TIE_TOL)


def test_architectures_are_registered_natively():
    assert {"Phi3ForCausalLM", "Gemma3ForCausalLM"} <= set(ARCHITECTURES)


def _write_config(path: Path, raw: dict) -> Path:
    (path / "config.json").write_text(json.dumps(raw))
    return path


_PHI35_MINI = {  # Phi-3.5-mini-instruct's config.json, sizes shrunk: 4.x names, factors outside the rope dict
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-05, "sliding_window": 262144, "tie_word_embeddings": False, "hidden_act": "silu",
    "partial_rotary_factor": 0.75,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 24, "long_factor": [2.0] * 24},
}


def test_phi3_4x_config_reads_as_transformers_reads_it(tmp_path):
    config = load_model_config(_write_config(tmp_path, _PHI35_MINI), tuple(ARCHITECTURES))
    assert (config.head_dim, config.rotary_dim, config.sliding_window) == (64, 48, 262144)
    scaling = config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096
    # factor = max_position_embeddings / original = 32, and transformers' default attention factor for it
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


@pytest.mark.parametrize("context", [4096, 4097])  # within, and beyond, the original 4096
def test_longrope_tables_are_transformers(context, tmp_path):
    """cos/sin per position as transformers' Phi-3 rotary gives them for a sequence of ``context`` tokens."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    model_dir = _write_config(tmp_path, _PHI35_MINI)
    ours = RotaryEmbedding(48, context, 10000.0, load_model_config(model_dir, tuple(ARCHITECTURES)).rope_scaling,
                           torch.float32, torch.device("cpu"))
    hf_rotary = Phi3RotaryEmbedding(AutoConfig.from_pretrained(model_dir))
    cos, sin = hf_rotary(torch.zeros(1), torch.arange(context)[None])
    torch.testing.assert_close(ours.cos, cos[0])
    torch.testing.assert_close(ours.sin, sin[0])


_GEMMA3_1B = {  # gemma-3-1b-it's config.json, sizes shrunk: 4.x names, windows by sliding_window_pattern
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512, "sliding_window_pattern": 6,
    "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "max_position_embeddings": 32768,
    "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
}


def test_gemma3_4x_config_reads_as_transformers_reads_it(tmp_path):
    config = load_model_config(_write_config(tmp_path, _GEMMA3_1B), tuple(ARCHITECTURES))
    assert [config.layer_window(i) for i in range(7)] == [512] * 5 + [-1, 512]
    assert (config.rope_theta, config.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6})
    assert (config.local_rope_theta, config.local_rope_scaling) == (10000.0, None)
    assert config.attention_scale == 64**-0.5 and config.tie_word_embeddings


def test_gemma3_attention_softcapping_is_refused(tmp_path):
    model_dir = _write_config(tmp_path, dict(_GEMMA3_1B, attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0 needs attention softcapping.*model_impl='native'"):
        LLM(model_dir, skip_tokenizer_init=True, model_impl="native")
    with pytest.raises(ValueError, match="needs attention softcapping.*native models cannot run it either"):
        LLM(model_dir, skip_tokenizer_init=True)
