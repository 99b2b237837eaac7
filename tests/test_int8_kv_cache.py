"""The engine on an int8 KV cache (LLM(kv_cache_dtype="int8")) against HF transformers run
with the same quantization: its attention quantizes every K and V row (one token of one kv
head) as ours does (contbatch.ops.reference.quantize_kv_rows) and attends over the
dequantized values, in fp32. Greedy tokens must match token for token (or at a proven
near-tie) in mixed batches, under preemption, with chunked prefill and prefix-cache hits,
and the chosen tokens' logprobs must be close. Against plain HF the same runs differ by
logit gaps up to ~0.6, from the quantization itself: the oracle has to share it. Also: how
many tokens the same memory holds, and the C++ decoder against the Python layers."""

import functools

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from contbatch import LLM, SamplingParams
from contbatch.engine.kv_cache import KVCacheSpec
from contbatch.models.loader import read_config
from contbatch.ops import reference
from tests.conftest import TINY_CONFIGS, HFOracle, assert_greedy_match
from tests.test_generate_oracle import EOS, SCENARIOS, _check_scenario, _run_and_spy, _tiny_prompts

# Both quantize the same fp32 K/V up to float noise, so a value on a rounding boundary may
# land one int8 step apart (1/254 of its row's largest): logits then differ by ~1e-2.
NEAR_TIE_TOL = 0.05
LOGPROB_TOL = 0.05
ORACLE_ATTENTION = "contbatch_int8_kv_oracle"


def _int8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention over K and V rounded through an int8 cache row and back."""
    def rounded(x: torch.Tensor) -> torch.Tensor:
        return reference.dequantize_kv_rows(reference.quantize_kv_rows(x)).to(x.dtype)

    return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)


@functools.cache
def _register_oracle_attention() -> None:
    AttentionInterface.register(ORACLE_ATTENTION, _int8_kv_sdpa)
    AttentionMaskInterface.register(ORACLE_ATTENTION, sdpa_mask)


class Int8KVOracle(HFOracle):
    """HFOracle (fp32, one request at a time) whose attention reads int8-rounded K/V."""

    def __init__(self, model_dir) -> None:
        _register_oracle_attention()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=ORACLE_ATTENTION
        ).eval()

    @torch.inference_mode()
    def token_logprobs(self, prompt: list[int], tokens: list[int]) -> list[float]:
        """log p(token) of each of ``tokens`` after ``prompt`` and the tokens before it."""
        logits = self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _assert_matches_oracle(model_dir, prompts, max_tokens, outputs) -> None:
    """Each output's greedy tokens are the oracle's (or differ first at a near-tie) and its
    chosen tokens' logprobs are the oracle's within LOGPROB_TOL."""
    oracle = Int8KVOracle(model_dir)
    for prompt, output, n in zip(prompts, outputs, max_tokens):
        ours = list(output.outputs[0].token_ids)
        assert_greedy_match(oracle, prompt, ours, oracle.greedy(prompt, n, EOS), NEAR_TIE_TOL)
        ours_logprobs = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, ours)]
        assert ours_logprobs == pytest.approx(oracle.token_logprobs(prompt, ours), abs=LOGPROB_TOL)


def _kwargs(model_dir, scenario: dict) -> dict:
    kwargs = dict(dtype="float32", max_model_len=192, kv_cache_dtype="int8")
    kwargs.update({k: v for k, v in scenario.items() if k != "kv_blocks"})
    if "kv_blocks" in scenario:  # the same number of blocks as the fp32 scenario, in int8 bytes
        spec = KVCacheSpec.for_model(read_config(model_dir), 16, torch.int8)
        kwargs["kv_cache_memory"] = scenario["kv_blocks"] * spec.bytes_per_block * len(spec.groups)
    return kwargs


@pytest.mark.parametrize("scenario_name", SCENARIOS)
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_greedy_tokens_and_logprobs_match_hf_with_int8_kv(arch, scenario_name, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    prompts, max_tokens = _tiny_prompts()
    llm = LLM(model_dir, skip_tokenizer_init=True, **_kwargs(model_dir, SCENARIOS[scenario_name]))
    assert llm.engine.runner.kv_cache.dtype == torch.int8
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0) for n in max_tokens]
    outputs, seen = _run_and_spy(llm, prompts, params)
    _assert_matches_oracle(model_dir, prompts, max_tokens, outputs)
    _check_scenario(llm, scenario_name, seen, outputs)


@pytest.mark.parametrize(("arch", "model_impl"), [("gemma3", "auto"), ("llama", "transformers")])
def test_other_layers_and_the_transformers_path_on_an_int8_cache(arch, model_impl, tiny_model_dirs,
                                                                 phi3_gemma3_model_dirs):
    """Gemma 3's KV-cache groups (sliding and global layers) and transformers' modeling code
    on contbatch's paged attention, in one mixed batch. (Not Phi-3's LongRoPE: HF switches its
    factors with the sequence's length, contbatch picks them by max_model_len; see
    tests/models/test_native_phi3_gemma3.py.)"""
    model_dir = {**tiny_model_dirs, **phi3_gemma3_model_dirs}[arch]
    prompts, max_tokens = _tiny_prompts()
    llm = LLM(model_dir, skip_tokenizer_init=True, model_impl=model_impl, **_kwargs(model_dir, SCENARIOS["mixed"]))
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=0) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _assert_matches_oracle(model_dir, prompts, max_tokens, outputs)


def test_the_same_memory_holds_about_twice_the_tokens_of_bf16(tiny_model_dirs):
    """head_dim 64: a bf16 row is 128 bytes, an int8 row 64 values and a 4-byte scale."""
    memory = 4 << 20
    blocks = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(tiny_model_dirs["llama"], skip_tokenizer_init=True, dtype="bfloat16", kv_cache_memory=memory,
                  kv_cache_dtype=kv_cache_dtype, max_model_len=192)
        blocks[kv_cache_dtype] = llm.engine.block_manager.num_blocks
        assert llm.engine.runner.kv_cache.nbytes <= memory
    head_dim = read_config(tiny_model_dirs["llama"]).head_dim
    assert blocks["int8"] == pytest.approx(blocks["auto"] * 2 * head_dim / (head_dim + 4), abs=1)


def test_native_decoder_and_python_layers_agree_on_an_int8_cache(tiny_model_dirs, monkeypatch):
    """Both call the same cache and attention functions on the same int8 tensors."""
    prompts, max_tokens = _tiny_prompts()
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=2) for n in max_tokens]
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("CONTBATCH_NATIVE_DECODER", native)
        llm = LLM(tiny_model_dirs["qwen3"], skip_tokenizer_init=True, dtype="bfloat16", kv_cache_dtype="int8",
                  max_num_batched_tokens=32, max_model_len=192)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    assert results[0] == results[1]
