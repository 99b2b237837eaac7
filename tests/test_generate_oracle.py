"""Greedy outputs equal HF transformers `generate` run on each request alone, token for token,
while the requests run together in mixed batches: plain, under KV-cache pressure
(preemption), with a tiny token budget (chunked prefill), and with shared prefixes
(prefix-cache hits). fp32 throughout; a divergence must be a proven near-tie. On the CPU
always, and on CUDA too when torch sees a GPU."""

import contextlib
import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
import torch

from contbatch import LLM, SamplingParams, ops
from contbatch.engine.kv_cache import KVCacheSpec
from contbatch.models.loader import read_config
from tests.conftest import TINY_CONFIGS, TINY_VOCAB, HFOracle, assert_greedy_match
from tests.ops.paged_batch import device_params, isa_params

NEAR_TIE_TOL = 1e-3  # fp32 logits: fused vs separate projections differ by ~1e-5
BF16_NEAR_TIE_TOL = 0.5  # bf16 logits, see test_smollm2_bf16_greedy_tokens_are_hf_bf16_argmax
EOS = 2
WORKLOAD = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / "chat256.jsonl"

SCENARIOS = {
    "mixed": dict(max_num_seqs=6),  # later requests join a running batch and hit the prefix cache
    # Nine blocks per KV-cache group, the fewest a max_model_len sequence needs: models with a
    # sliding window free blocks as they go, and preempt only under this pressure.
    "preemption": dict(kv_blocks=9, max_num_seqs=8, max_model_len=144),
    "chunked-prefill": dict(max_num_batched_tokens=16),
}


def _tiny_prompts() -> tuple[list[list[int]], list[int]]:
    """Mixed lengths (1 to ~90 tokens, several blocks), some sharing a 40-token prefix."""
    rng = random.Random(1234)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]
    prompts = []
    for i in range(14):
        tail = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(1, 50))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
    max_tokens = [rng.randrange(1, 40) for _ in prompts]
    return prompts, max_tokens


def _engine_kwargs(model_dir: Path, scenario: dict, max_model_len: int, device: str = "cpu") -> dict:
    kwargs = dict(dtype="float32", device=device, max_model_len=max_model_len)
    kwargs.update({k: v for k, v in scenario.items() if k != "kv_blocks"})
    if "kv_blocks" in scenario:
        spec = KVCacheSpec.for_model(read_config(model_dir), 16, _torch_float32())
        kwargs["kv_cache_memory"] = scenario["kv_blocks"] * spec.bytes_per_block * len(spec.groups)  # in every group
    return kwargs


def _torch_float32():
    import torch

    return torch.float32


def _run_and_spy(llm: LLM, prompts, params) -> tuple[list, dict]:
    """generate(), recording whether a prefill chunk ever stopped short of its prompt's end."""
    seen = {"chunked": False}

    def watch(stats):
        seen["chunked"] |= stats.num_sampled < stats.num_running

    llm.engine.add_stats_listener(watch)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.remove_stats_listener(watch)
    return outputs, seen


def _check_scenario(llm: LLM, scenario_name: str, seen: dict, outputs) -> None:
    assert any(o.num_cached_tokens > 0 for o in outputs), "shared prefixes never hit the prefix cache"
    assert llm.engine.stats.num_prefix_hit_tokens > 0
    if scenario_name == "preemption":
        assert llm.engine.stats.num_preemptions > 0, "the small KV cache never forced a preemption"
    if scenario_name == "chunked-prefill":
        assert seen["chunked"], "no prompt was prefilled in chunks"


@pytest.fixture(scope="module")
def tiny_oracle_outputs(tiny_model_dirs):
    """HF greedy outputs per architecture, each request alone (computed once)."""
    prompts, max_tokens = _tiny_prompts()
    return {
        arch: [HFOracle(path).greedy(p, n, EOS) for p, n in zip(prompts, max_tokens)]
        for arch, path in tiny_model_dirs.items()
    }


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("scenario_name", SCENARIOS)
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_tiny_models_match_hf(arch, scenario_name, device, tiny_model_dirs, tiny_oracle_outputs):
    model_dir = tiny_model_dirs[arch]
    prompts, max_tokens = _tiny_prompts()
    kwargs = _engine_kwargs(model_dir, SCENARIOS[scenario_name], 192, device)
    llm = LLM(model_dir, skip_tokenizer_init=True, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    # A generator exercises lazy admission; outputs must still come back in input order.
    outputs, seen = _run_and_spy(llm, (p for p in prompts), params)

    assert [int(o.request_id) for o in outputs] == list(range(len(prompts)))
    oracle = None
    for prompt, output, expected in zip(prompts, outputs, tiny_oracle_outputs[arch]):
        assert output.prompt_token_ids == prompt
        if output.outputs[0].token_ids != expected:
            oracle = oracle or HFOracle(model_dir)
            assert_greedy_match(oracle, prompt, output.outputs[0].token_ids, expected, NEAR_TIE_TOL)
    _check_scenario(llm, scenario_name, seen, outputs)


@pytest.mark.parametrize("scenario_name", SCENARIOS)
@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_tiny_models_match_hf_on_reference_ops(arch, scenario_name, tiny_model_dirs, tiny_oracle_outputs, monkeypatch):
    """The pure-PyTorch fallback is exact too (the tests above run on the compiled ops when built)."""
    monkeypatch.setenv("CONTBATCH_NATIVE_DECODER", "0")  # it calls the compiled ops from C++
    for name in ("reshape_and_cache", "paged_attention", "copy_blocks"):
        monkeypatch.setattr(ops, name, getattr(ops.reference, name))
    model_dir = tiny_model_dirs[arch]
    prompts, max_tokens = _tiny_prompts()
    llm = LLM(model_dir, skip_tokenizer_init=True, **_engine_kwargs(model_dir, SCENARIOS[scenario_name], 192))
    outputs, seen = _run_and_spy(llm, prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])
    oracle = HFOracle(model_dir)
    for prompt, output, expected in zip(prompts, outputs, tiny_oracle_outputs[arch]):
        assert_greedy_match(oracle, prompt, output.outputs[0].token_ids, expected, NEAR_TIE_TOL)
    _check_scenario(llm, scenario_name, seen, outputs)


def _chat_prompts(count: int) -> tuple[list[str], list[int]]:
    rows = [json.loads(line) for line in WORKLOAD.read_text().splitlines()[:count]]
    shared_system = rows[0]["prompt"]  # repeated verbatim below so prefixes are shared
    prompts = [row["prompt"] for row in rows] + [shared_system, shared_system + "More, please."]
    max_tokens = [min(row["max_tokens"], 24) for row in rows] + [12, 20]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def smollm_oracle(smollm_dir):
    return HFOracle(smollm_dir)


@pytest.fixture(scope="module")
def smollm_expected(smollm_dir, smollm_oracle):
    from contbatch.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm_dir)
    prompts, max_tokens = _chat_prompts(10)
    prompt_ids = [tokenizer(p).input_ids for p in prompts]
    return prompt_ids, [smollm_oracle.greedy(ids, n, EOS) for ids, n in zip(prompt_ids, max_tokens)]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("scenario_name", ["mixed", "preemption-and-chunked"])
def test_smollm2_matches_hf(scenario_name, device, smollm_dir, smollm_oracle, smollm_expected):
    scenario = dict(kv_blocks=40, max_num_seqs=12, max_num_batched_tokens=64)
    if scenario_name == "mixed":
        scenario = SCENARIOS["mixed"]
    prompts, max_tokens = _chat_prompts(10)
    llm = LLM(smollm_dir, **_engine_kwargs(smollm_dir, scenario, 512, device))
    outputs, seen = _run_and_spy(llm, prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])

    prompt_ids, expected = smollm_expected
    for ids, output, theirs in zip(prompt_ids, outputs, expected):
        assert output.prompt_token_ids == ids
        assert_greedy_match(smollm_oracle, ids, output.outputs[0].token_ids, theirs, NEAR_TIE_TOL)
        completion = output.outputs[0]
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if completion.token_ids[-1] == EOS else "length")
    assert any(o.outputs[0].finish_reason == "stop" for o in outputs), "EOS never ended a request"
    if scenario_name != "mixed":
        assert llm.engine.stats.num_preemptions > 0 and seen["chunked"]
    assert llm.engine.stats.num_prefix_hit_tokens > 0


def test_compiled_ops_are_what_ran():
    """When the extension is built (CI requires it), the oracle tests above ran on the
    compiled kernels, not on the reference."""
    forced = os.environ.get("CONTBATCH_FORCE_REFERENCE_OPS") == "1"
    if os.environ.get("CONTBATCH_REQUIRE_EXT") != "1" and (forced or importlib.util.find_spec("contbatch._C") is None):
        pytest.skip("extension not built or reference ops forced: the tests ran on the reference")
    assert ops.BACKEND == "native"
    assert ops.paged_attention is torch.ops.contbatch.paged_attention


@pytest.mark.parametrize("isa", isa_params() if ops.BACKEND == "native" else ["reference"])
@pytest.mark.parametrize("batched", [False, True])
def test_smollm2_bf16_greedy_tokens_are_hf_bf16_argmax(batched, isa, smollm_dir, smollm_expected):
    """bf16, the default wherever the extension runs an AVX2 tier or better, with the
    panel-layout linear kernel of every tier: every greedy token we pick is HF's bf16 argmax
    given the same prefix, or within bf16 rounding of it. One request alone (1-row matmuls)
    and ten together (up to ~300 rows), on each ISA tier this CPU has."""
    from transformers import AutoModelForCausalLM

    prompt_ids, _ = smollm_expected
    prompt_ids = prompt_ids if batched else prompt_ids[:1]
    with ops.use_cpu_isa(isa) if isa != "reference" else contextlib.nullcontext():
        llm = LLM(smollm_dir, dtype="bfloat16", device="cpu", max_model_len=512, skip_tokenizer_init=True)
        if ops.bf16_linear_available():
            assert llm.engine.runner.model.layers[0].mlp.gate_up_proj.packed_weight.layout == "panels"
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.bfloat16).eval()
    for ids, output in zip(prompt_ids, outputs):
        ours = output.outputs[0].token_ids
        assert len(ours) == 24
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + ours])).logits[0, len(ids) - 1 : -1].float()
        gaps = logits.max(dim=-1).values - logits[torch.arange(len(ours)), torch.tensor(ours)]
        # bf16 logits of SmolLM2 (|logit| < 32) are spaced 0.125 apart; sums in another
        # order move them by a few steps. A wrong token scores many units below the argmax.
        assert float(gaps.max()) <= BF16_NEAR_TIE_TOL, f"gaps per token: {gaps.tolist()}"



@pytest.fixture(scope="module")
def smollm_long_prompt(smollm_dir, smollm_oracle) -> tuple[list[int], list[int]]:
    """A 1,400-token prompt (the chat prompts' tokens end to end) and HF's 8 greedy tokens."""
    from contbatch.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm_dir)
    rows = [json.loads(line)["prompt"] for line in WORKLOAD.read_text().splitlines()]
    ids = [token for row in rows for token in tokenizer(row).input_ids][:1400]
    return ids, smollm_oracle.greedy(ids, 8, None)


@pytest.mark.parametrize("isa", isa_params() if ops.BACKEND == "native" else ["reference"])
def test_smollm2_long_prompt_in_long_chunks_matches_hf(isa, smollm_dir, smollm_oracle, smollm_long_prompt, monkeypatch):
    """A prompt prefilled in two chunks of 512+ query rows, the second after the first's keys,
    beside a short request: the long-chunk path of each tier (sdpa with log-sum-exp merging on
    avx2 and generic, the paged kernel on the AVX-512 tiers; layers/dense_prefill.py) gives
    HF's greedy tokens."""
    from contbatch.layers import dense_prefill

    dense_calls = []
    attend = dense_prefill.attend
    monkeypatch.setattr(dense_prefill, "attend", lambda *args: dense_calls.append(1) or attend(*args))
    long_ids, expected = smollm_long_prompt
    short_ids = long_ids[:40]
    with ops.use_cpu_isa(isa) if isa != "reference" else contextlib.nullcontext():
        llm = LLM(smollm_dir, dtype="float32", device="cpu", max_model_len=1536, max_num_batched_tokens=768,
                  enable_prefix_caching=False, skip_tokenizer_init=True)
        outputs = llm.generate(
            [{"prompt_token_ids": long_ids}, {"prompt_token_ids": short_ids}],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    assert_greedy_match(smollm_oracle, long_ids, outputs[0].outputs[0].token_ids, expected, NEAR_TIE_TOL)
    assert_greedy_match(smollm_oracle, short_ids, outputs[1].outputs[0].token_ids,
                        smollm_oracle.greedy(short_ids, 8, None), NEAR_TIE_TOL)
    assert bool(dense_calls) == (isa not in dense_prefill.PAGED_LONG_CHUNK_TIERS)


@pytest.mark.parametrize("kv_blocks", [16, 20])
def test_parallel_samples_under_kv_pressure_match_hf(kv_blocks, tiny_model_dirs):
    """n=3 samples share their prompt's blocks (a partly filled last one, copied on write)
    while a cache of 16 or 20 blocks (a 192-token sequence needs 12) preempts them: a block
    one sample copies from can be freed by a preemption and taken as another copy's
    destination in the same step. Every sample is still HF's greedy output."""
    model_dir = tiny_model_dirs["llama"]
    rng = random.Random(kv_blocks)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(100)] for _ in range(3)]
    llm = LLM(model_dir, skip_tokenizer_init=True, **_engine_kwargs(model_dir, dict(kv_blocks=kv_blocks), 192))
    copies = []
    llm.engine.add_stats_listener(lambda stats: copies.append(stats.num_copied_blocks))
    params = SamplingParams(temperature=0, max_tokens=16, n=3, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    oracle = HFOracle(model_dir)
    for prompt, output in zip(prompts, outputs):
        expected = oracle.greedy(prompt, 16, None)
        for sample in output.outputs:
            assert_greedy_match(oracle, prompt, sample.token_ids, expected, NEAR_TIE_TOL)
    assert llm.engine.stats.num_preemptions > 0 and sum(copies) > 0
