"""LoRA adapters (contbatch/lora) against PEFT on HF transformers, token by token.

The adapters are made by PEFT itself (``get_peft_model`` with random A and B, saved with
``save_pretrained``), and the oracle is PEFT's own forward: ``PeftModel.from_pretrained`` on the
HF model, greedy ``generate`` one request at a time. Nothing expected is computed by contbatch.
"""

import json
from pathlib import Path

import pytest
import torch

from contbatch import LLM, LoRARequest, SamplingParams
from contbatch.engine.block_manager import BlockManager
from contbatch.engine.scheduler import Scheduler
from tests.conftest import HFOracle, assert_greedy_match, make_peft_adapter

peft = pytest.importorskip("peft")

PROMPTS = [[1, 17, 33, 250, 9, 71], [1, 400, 3, 3, 18], [1, 5, 6, 7, 8, 9, 10, 11, 12, 100, 200, 300, 44, 45, 46, 47, 48, 49]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Adapters whose layers PEFT adapts differently: every projection (fused q|k|v and gate|up
# filled from separate q/k/v and gate/up pieces), and a few with rsLoRA and per-module alpha.
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"]),
    "some": dict(r=4, lora_alpha=6, target_modules=["k_proj", "v_proj", "up_proj", "down_proj"], use_rslora=True,
                 alpha_pattern={"down_proj": 3}),
}
TOLERANCE = 1e-3  # fp32 near-tie rule of assert_greedy_match


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    return {
        name: LoRARequest(name, index + 1, str(make_peft_adapter(llama_dir, tmp_path_factory.mktemp(name), index, **settings)))
        for index, (name, settings) in enumerate(ADAPTERS.items())
    }


def _llm(model_dir: Path, **settings) -> LLM:
    return LLM(model_dir, skip_tokenizer_init=True, **settings)  # the tiny models have no tokenizer


def _peft_oracle(model_dir: Path, adapter: LoRARequest | None) -> HFOracle:
    oracle = HFOracle(model_dir)
    if adapter is not None:
        oracle.model = peft.PeftModel.from_pretrained(oracle.model, adapter.lora_path).eval()
    return oracle


def _expect(oracle: HFOracle, ours: list[int], prompt: list[int]) -> None:
    theirs = oracle.greedy(prompt, GREEDY.max_tokens, None)
    assert_greedy_match(oracle, prompt, ours, theirs, TOLERANCE)


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_gives_peft_tokens(llama_dir, adapters, name):
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    ours = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                             lora_request=adapters[name]))
    oracle = _peft_oracle(llama_dir, adapters[name])
    base = HFOracle(llama_dir)
    for prompt, tokens in zip(PROMPTS, ours):
        _expect(oracle, tokens, prompt)
        assert tokens != base.greedy(prompt, GREEDY.max_tokens, None), "the adapter changed nothing: a weak test"


@pytest.mark.parametrize("max_loras", [1, 2])
def test_adapters_and_the_base_model_mixed_in_one_batch(llama_dir, adapters, max_loras):
    """Requests of two adapters and of none, in one call, each as it would run alone under PEFT;
    with max_loras=1 the scheduler runs one adapter's requests at a time, with the same tokens."""
    loras = [adapters["all"], None, adapters["some"], adapters["all"], None, adapters["some"]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=max_loras)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    ours = _ids(outputs)
    oracles = {None: HFOracle(llama_dir), **{a.lora_int_id: _peft_oracle(llama_dir, a) for a in adapters.values()}}
    for prompt, lora, tokens in zip(prompts, loras, ours):
        _expect(oracles[None if lora is None else lora.lora_int_id], tokens, prompt)
    assert [o.lora_request for o in outputs] == loras  # each output names its adapter, as vLLM's


def test_each_prompt_of_a_stream_names_its_own_adapter(llama_dir, adapters):
    """A dict prompt's "lora_request" overrides the call's: a lazy generator and a PromptQueue
    mixing two adapters and the base model give each prompt PEFT's tokens for its own adapter."""
    from contbatch import PromptQueue

    loras = [adapters["all"], None, adapters["some"], adapters["all"], None, adapters["some"]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    items = [{"prompt_token_ids": p, "lora_request": lora} for p, lora in zip(prompts, loras)]
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2)
    streamed = llm.generate((item for item in items), GREEDY, use_tqdm=False)
    queue = PromptQueue()
    for item in items:
        queue.put(item)
    queue.close()
    queued = sorted(llm.iter_generate(queue, GREEDY), key=lambda o: int(o.request_id))
    oracles = {None: HFOracle(llama_dir), **{a.lora_int_id: _peft_oracle(llama_dir, a) for a in adapters.values()}}
    for prompt, lora, tokens in zip(prompts, loras, _ids(streamed)):
        _expect(oracles[None if lora is None else lora.lora_int_id], tokens, prompt)
    assert _ids(queued) == _ids(streamed)
    assert [o.lora_request for o in streamed] == loras


def test_a_prompts_own_adapter_overrides_the_calls(llama_dir, adapters):
    """In a list too: the call's adapter for the prompts that name none, theirs for the others."""
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    items = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[0], "lora_request": adapters["some"]}]
    outputs = llm.generate(items, GREEDY, use_tqdm=False, lora_request=adapters["all"])
    assert [o.lora_request for o in outputs] == [adapters["all"], adapters["some"]]
    _expect(_peft_oracle(llama_dir, adapters["all"]), _ids(outputs)[0], PROMPTS[0])
    _expect(_peft_oracle(llama_dir, adapters["some"]), _ids(outputs)[1], PROMPTS[0])


def test_a_bad_adapter_in_a_prompt_ends_that_prompt_only(llama_dir, adapters, tmp_path):
    """In a list: one ValueError naming the prompt, before any work. In a stream: that prompt's
    output carries the error and the others run."""
    missing = LoRARequest("missing", 9, str(tmp_path / "no-adapter"))
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    items = [{"prompt_token_ids": PROMPTS[0], "lora_request": adapters["all"]},
             {"prompt_token_ids": PROMPTS[1], "lora_request": missing},
             {"prompt_token_ids": PROMPTS[2], "lora_request": "all"}]
    with pytest.raises(ValueError, match=r"2 invalid prompt\(s\).*prompts\[1\]: LoRA adapter .*no-adapter.* is not a "
                                         r"directory.*prompts\[2\]: a prompt's 'lora_request' must be a LoRARequest"):
        llm.generate(items, GREEDY, use_tqdm=False)
    outputs = llm.generate((item for item in items), GREEDY, use_tqdm=False)
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert "is not a directory" in outputs[1].error and "must be a LoRARequest" in outputs[2].error
    without_lora = _llm(llama_dir, dtype="float32")
    [refused] = without_lora.generate(iter(items[:1]), GREEDY, use_tqdm=False)
    assert refused.error == "lora_request needs LLM(..., enable_lora=True)"


def test_forked_samples_keep_their_adapter(llama_dir, adapters):
    """n > 1: samples forked from a prompt run with its adapter (greedy, so every sample is PEFT's)."""
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    [output] = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False, lora_request=adapters["all"])
    oracle = _peft_oracle(llama_dir, adapters["all"])
    for sample in output.outputs:
        _expect(oracle, list(sample.token_ids), PROMPTS[0])


def test_cached_prefixes_are_not_shared_across_adapters(llama_dir, adapters):
    """A prompt computed under an adapter leaves its blocks in the prefix cache; the same prompt
    on the base model (and under the other adapter) must not reuse those K/V."""
    prompt = [1] + [(7 * i) % 500 + 3 for i in range(70)]  # several full 16-token blocks
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8, enable_prefix_caching=True)
    order = [adapters["all"], None, adapters["some"], adapters["all"]]
    results = [_ids(llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora))[0]
               for lora in order]
    assert results[0] == results[3]  # the same adapter again may reuse its own blocks
    oracles = [HFOracle(llama_dir) if lora is None else _peft_oracle(llama_dir, lora) for lora in order[:3]]
    for oracle, tokens in zip(oracles, results[:3]):
        _expect(oracle, tokens, prompt)


def test_adapter_on_a_preempting_cache_and_on_bf16(llama_dir, adapters):
    """A cache small enough to preempt gives the same tokens; bf16 runs the same path."""
    prompts = [{"prompt_token_ids": PROMPTS[i % 3] + [i + 20] * 20} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    tight = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=16, max_model_len=64,
                kv_cache_memory=12 * 16 * 2 * 2 * 2 * 64 * 4)  # 12 blocks for 8 requests of ~50 tokens
    expected = _ids(roomy.generate(prompts, params, use_tqdm=False, lora_request=adapters["all"]))
    assert _ids(tight.generate(prompts, params, use_tqdm=False, lora_request=adapters["all"])) == expected
    assert tight.engine.stats.num_preemptions > 0
    bf16 = _llm(llama_dir, dtype="bfloat16", enable_lora=True, max_lora_rank=8)
    got = _ids(bf16.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=adapters["all"]))
    base = _ids(bf16.generate(prompts[:2], GREEDY, use_tqdm=False))
    assert got != base


def test_scheduler_runs_at_most_max_loras_adapters_at_once():
    scheduler = Scheduler(BlockManager(64, 16, True), max_num_seqs=8, max_num_batched_tokens=256,
                          max_model_len=128, max_loras=1)
    adapters = {lora_id: LoRARequest(str(lora_id), lora_id, f"/adapters/{lora_id}") for lora_id in (3, 5)}
    for request_id, lora_id in enumerate([3, 5, 0, 3, 5]):
        scheduler.add_request(request_id, None, [1, 2, 3, 4], SamplingParams(max_tokens=4),
                              lora_request=adapters.get(lora_id))
    step = scheduler.schedule()
    admitted = {new.request_id: new.lora_id for new in step.new_seqs}
    assert admitted == {0: 3, 2: 0, 3: 3}  # adapter 5 waits; the base request does not
    assert [r.request_id for r in scheduler.waiting] == [1, 4]


# ---- refusals: named, before any work ----

def test_lora_request_without_enable_lora_is_refused(llama_dir, adapters):
    llm = _llm(llama_dir, dtype="float32")
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=adapters["all"])


def test_bad_adapters_are_refused_by_name_before_any_work(llama_dir, adapters, tmp_path, tiny_model_dirs):
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=4)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with pytest.raises(ValueError, match=r"lora_request\[1\].*rank 8.*max_lora_rank=4"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[adapters["some"], adapters["all"], None])
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="nowhere.*not a directory"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 9, missing))
    with pytest.raises(ValueError, match="has 2 entries but there are 3 prompts"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[None, None])
    with pytest.raises(TypeError, match=r"lora_request\[0\] must be a LoRARequest"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=["adapter", None, None])
    with pytest.raises(ValueError, match="lora_int_id 2 is the adapter at"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[adapters["some"], None,
                                                                    LoRARequest("other", 2, adapters["all"].lora_path)])
    other_model = make_peft_adapter(tiny_model_dirs["qwen3"], tmp_path / "qwen3", 0, r=4, target_modules=["o_proj"])
    with pytest.raises(ValueError, match="another base model"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("qwen3", 7, str(other_model)))
    assert llm.engine.stats.num_steps == 0  # nothing ran
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=adapters["some"]))  # still serves


@pytest.mark.parametrize("setting,message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
])
def test_adapter_settings_we_cannot_compute_are_refused(llama_dir, adapters, tmp_path, setting, message):
    source = Path(adapters["some"].lora_path)
    copy = tmp_path / "adapter"
    copy.mkdir()
    (copy / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    settings = {**json.loads((source / "adapter_config.json").read_text()), **setting}
    (copy / "adapter_config.json").write_text(json.dumps(settings))
    llm = _llm(llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("bad", 1, str(copy)))


@pytest.mark.parametrize("fields,message", [
    (("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"), (("a", True, "/x"), "lora_int_id"),
    (("a", 1, ""), "lora_path"),
])
def test_lora_request_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*fields)


def test_smollm2_with_an_adapter_gives_peft_tokens(smollm_dir, tmp_path):
    """The real model and tokenizer: a rank-16 adapter of every projection, large enough to
    change the reply, through chat() as a user would call it."""
    adapter = LoRARequest("smol", 1, str(make_peft_adapter(smollm_dir, tmp_path / "smol", 0, scale=0.5, r=16,
                                                       lora_alpha=32, target_modules=ADAPTERS["all"]["target_modules"])))
    llm = LLM(smollm_dir, dtype="float32", enable_lora=True)
    conversations = [[{"role": "user", "content": text}] for text in ("Name a colour.", "What is 2 + 3?")]
    params = SamplingParams(temperature=0, max_tokens=16)
    outputs = llm.chat(conversations, params, use_tqdm=False, lora_request=adapter)
    base = llm.chat(conversations, params, use_tqdm=False)
    oracle = _peft_oracle(smollm_dir, adapter)
    eos = list(llm.engine.eos_token_ids)
    for output in outputs:
        ids = list(output.prompt_token_ids)
        assert_greedy_match(oracle, ids, list(output.outputs[0].token_ids), oracle.greedy(ids, 16, eos), TOLERANCE)
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in base]


def test_a_gguf_file_takes_the_adapter_of_its_dense_model(smollm_dir, smollm_gguf, tmp_path):
    """The demo GGUF file (Q4_1 layers dequantized at load) names its layers as llama.cpp does; an
    adapter trained on the HF directory converted from it gives the same tokens on both."""
    adapter = LoRARequest("smol", 1, str(make_peft_adapter(smollm_dir, tmp_path / "smol", 1, scale=0.5, r=8,
                                                           target_modules=["q_proj", "v_proj", "down_proj"])))
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for model in (smollm_gguf, smollm_dir):
        llm = LLM(model, dtype="float32", enable_lora=True)
        results.append((_ids(llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)),
                        _ids(llm.generate(prompts, params, use_tqdm=False))))
    (gguf, gguf_base), (dense, dense_base) = results
    assert gguf == dense and gguf_base == dense_base and gguf != gguf_base


def test_int8_weights_take_the_adapter_update_too(llama_dir, adapters):
    """quantization="int8": the update adds to the int8 layers' output. The tiny model's logits
    are decisive, so int8 with the adapter follows PEFT's fp32 tokens for the first steps, and
    not the base model's."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = _llm(llama_dir, dtype="float32", quantization="int8", enable_lora=True, max_lora_rank=8)
    ours = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                             lora_request=adapters["all"]))
    oracle, base = _peft_oracle(llama_dir, adapters["all"]), HFOracle(llama_dir)
    agree = sum(tokens == oracle.greedy(p, 4, None) for p, tokens in zip(PROMPTS, ours))
    from_base = sum(tokens == base.greedy(p, 4, None) for p, tokens in zip(PROMPTS, ours))
    assert agree >= 2 and from_base == 0, (agree, from_base)


ARCHITECTURE_TARGETS = {  # the modules PEFT adapts, named as each checkpoint names them
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # qkv bias
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],  # q/k norms after the update
    "mistral-window": ["q_proj", "v_proj", "up_proj"],
    "phi4-mini-partial": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused in the checkpoint
    "gemma3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.mark.parametrize("name", list(ARCHITECTURE_TARGETS))
def test_every_native_architecture_gives_peft_tokens(name, tiny_model_dirs, phi3_gemma3_model_dirs, tmp_path):
    model_dir = {**tiny_model_dirs, **phi3_gemma3_model_dirs}[name]
    adapter = LoRARequest(name, 1, str(make_peft_adapter(model_dir, tmp_path / name, 3, scale=4.0, r=8, lora_alpha=8,
                                                         target_modules=ARCHITECTURE_TARGETS[name])))
    # LongRoPE's factors follow max_model_len; within the original context they are HF's short ones.
    context = json.loads((model_dir / "config.json").read_text()).get("original_max_position_embeddings")
    llm = _llm(model_dir, dtype="float32", enable_lora=True, max_model_len=context)
    ours = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                             lora_request=adapter))
    oracle, base = _peft_oracle(model_dir, adapter), HFOracle(model_dir)
    for prompt, tokens in zip(PROMPTS, ours):
        _expect(oracle, tokens, prompt)
    assert ours != [base.greedy(p, GREEDY.max_tokens, None) for p in PROMPTS], "the adapter changed nothing"
