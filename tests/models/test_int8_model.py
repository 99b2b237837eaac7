"""``LLM(quantization="int8")`` end to end, against HF transformers running the same int8
arithmetic: SmolLM2 in HF with each ``nn.Linear`` (the LM head too) replaced by Q8_0 weights
(narrow but the LM head's where the LLM quantized so: ops.int8_weight_qmax) and per-token int8
activations computed by the float64 reference (contbatch/ops/int8_blocks.py).
Our greedy tokens must be that model's argmax at every step given the same prefix, up to a
near-tie (INT8_NEAR_TIE_TOL)."""

import contextlib
import json

import pytest
import torch
from torch import nn

from contbatch import LLM, SamplingParams, ops
from contbatch.ops import int8_blocks
from tests.ops.paged_batch import AMX_INT8, int8_kernel_params, isa_params, use_int8_kernel

# fp32 sums in another order flip some activations' rounding to the neighbouring int8 value:
# one step is up to 1/254 of its block's largest value, about bf16's rounding step (1/256),
# and the flips compound over 30 layers as bf16 roundings do. So the bf16 oracle's tolerance
# (test_generate_oracle.py); a wrong token scores whole units below the argmax.
INT8_NEAR_TIE_TOL = 0.5
MAX_TOKENS = 16


class FakeQuantLinear(nn.Module):
    """``nn.Linear`` computing what the int8 kernel computes, in float64 (then fp32), in
    blocks of ``block`` inputs, the weight's |q| up to qmax."""

    def __init__(self, linear: nn.Linear, block: int, qmax: int) -> None:
        super().__init__()
        self.block = block
        self.weight = int8_blocks.quantize_weight(linear.weight.detach(), block, qmax)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int8_blocks.quantize_activations(x.reshape(-1, x.shape[-1]), self.block)
        out = int8_blocks.int8_linear_reference(rows, self.weight, self.bias)
        return out.float().view(*x.shape[:-1], -1)


def _fake_quant_hf(model_dir, block: int, qmax: int, embeddings: bool = False):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if embeddings:  # the table's int8 values, dequantized; the tied head is quantized on its own below
        table = hf.get_input_embeddings().weight
        hf.set_input_embeddings(nn.Embedding.from_pretrained(int8_blocks.quantize_weight(table, block).dequantize()))
    head = hf.get_output_embeddings()  # all 8 bits whatever qmax (contbatch/ops/int8_blocks.py)
    for parent in list(hf.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, FakeQuantLinear(child, block, int8_blocks.QMAX if child is head else qmax))
    return hf


@pytest.fixture(scope="module")
def fake_quant_hf(smollm_dir):
    """The reference model for an LLM's quantization (its block and qmax, which the int8
    kernel it ran chose: ops.int8_weight_block, ops.int8_weight_qmax), one per kind."""
    models = {}

    def for_quantization(quantization):
        kind = (quantization.block, quantization.qmax)
        if kind not in models:
            models[kind] = _fake_quant_hf(smollm_dir, *kind)
        return models[kind]

    return for_quantization


def _prompts(llm: LLM, count: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 5, 8,",
             "Water boils at", "The quick brown fox", "In 1969, humans", "A haiku about rain:",
             "SELECT name FROM", "The mitochondria is"]  # fmt: skip
    return [tokenizer.encode(text) for text in texts[:count]]


def _assert_argmax_of(hf, prompt_ids, outputs) -> None:
    for ids, output in zip(prompt_ids, outputs):
        ours = output.outputs[0].token_ids
        assert len(ours) == MAX_TOKENS
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + ours])).logits[0, len(ids) - 1 : -1].float()
        gaps = logits.max(dim=-1).values - logits[torch.arange(len(ours)), torch.tensor(ours)]
        assert float(gaps.max()) <= INT8_NEAR_TIE_TOL, f"gaps per token: {gaps.tolist()}"


@pytest.mark.parametrize("isa", isa_params() if ops.BACKEND == "native" else ["reference"])
@pytest.mark.parametrize("batched", [False, True])
def test_int8_greedy_tokens_are_fake_quant_hf_argmax(batched, isa, smollm_dir, fake_quant_hf):
    """One request alone (1-row matmuls) and ten together, on every ISA tier this CPU has."""
    with ops.use_cpu_isa(isa) if isa != "reference" else contextlib.nullcontext():
        llm = LLM(smollm_dir, dtype="float32", quantization="int8", max_model_len=256)
        prompt_ids = _prompts(llm, 10 if batched else 1)
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    model = llm.engine.runner.model
    assert model.layers[0].mlp.gate_up_proj.packed_weight.layout == "int8"
    assert model.tied_head_packed.layout == "int8"
    _assert_argmax_of(fake_quant_hf(llm.engine.quantization), prompt_ids, outputs)


@pytest.mark.skipif(ops.BACKEND != "native", reason="the int8 kernels are in the C++ extension")
@pytest.mark.parametrize("kernel", int8_kernel_params())
def test_int8_greedy_tokens_on_every_int8_kernel(kernel, smollm_dir, fake_quant_hf):
    """Each int8 kernel this CPU has (a tier runs one: AVX-VNNI's hides AVX2's where both run),
    ten requests together, under the best tier."""
    with use_int8_kernel(kernel):
        llm = LLM(smollm_dir, dtype="float32", quantization="int8", max_model_len=256)
        prompt_ids = _prompts(llm, 10)
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    _assert_argmax_of(fake_quant_hf(llm.engine.quantization), prompt_ids, outputs)


def test_int8_embeddings_share_the_head_copy(smollm_dir):
    """quantize_embeddings: the lookup gives the Q8_0 rows dequantized, from the same int8
    copy as the tied head, and greedy tokens are the fake-quantized HF model's argmax."""
    llm = LLM(smollm_dir, dtype="float32", quantization="int8", quantize_embeddings=True, max_model_len=256)
    model = llm.engine.runner.model
    assert model.embed_tokens.packed is model.tied_head_packed.data
    hf = _fake_quant_hf(smollm_dir, ops.int8_weight_block(), ops.int8_weight_qmax(), embeddings=True)
    ids = torch.tensor([[0, 1, 63, 64, 65, 49151], [5, 5, 100, 2000, 30000, 49087]])
    assert torch.equal(model.embed_tokens(ids), hf.get_input_embeddings()(ids))
    prompt_ids = _prompts(llm, 4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    _assert_argmax_of(hf, prompt_ids, outputs)


def test_bf16_activations_and_dense_head(smollm_dir):
    """bf16 model, int8 linear layers, LM head kept dense: the head is the bf16 panel kernel,
    and greedy tokens stay the unquantized bf16 model's on most steps. Ten prompts: over four,
    two early near-tie flips took the share under half (28 of 64 tokens with 64-input blocks
    on the AVX2 stand-in; 95 of 160 over these ten)."""
    llm = LLM(smollm_dir, dtype="bfloat16", quantization="int8", quantize_lm_head=False, max_model_len=256)
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.packed_weight.layout == "int8"
    assert model.tied_head_packed.layout != "int8"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in _prompts(llm, 10)]
    int8 = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    dense = LLM(smollm_dir, dtype="bfloat16", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]
    leading = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), MAX_TOKENS) for x, y in zip(int8, reference)]
    assert sum(leading) >= 0.5 * MAX_TOKENS * len(prompts), f"tokens before the first difference: {leading}"


def test_transformers_path_quantizes_the_same(smollm_dir, fake_quant_hf):
    """model_impl="transformers": the same int8 layers, so its greedy tokens too are the
    fake-quantized HF model's argmax (its norms and attention are not the native path's, so
    int8 roundings can flip where the native path's do not: both are held to the oracle)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(smollm_dir, dtype="float32", quantization="int8", model_impl="transformers", max_model_len=128)
    assert llm.engine.runner.model.head.lm_head.packed_weight.layout == "int8"
    prompt_ids = _prompts(llm, 3)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    _assert_argmax_of(fake_quant_hf(llm.engine.quantization), prompt_ids, outputs)


def test_features_on_int8(smollm_dir):
    """Sampling with seeds, n > 1, logprobs and structured outputs on int8 weights: seeded
    samples are the same alone and in a batch, logprobs are log-softmax values, and the
    structured output parses."""
    llm = LLM(smollm_dir, dtype="float32", quantization="int8", max_model_len=256)
    sampled = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8, logprobs=2)
    alone = llm.generate(["Tell me a story."], sampled, use_tqdm=False)[0]
    together = llm.generate(["Tell me a story.", "Hi"], sampled, use_tqdm=False)[0]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in together.outputs]
    for completion in alone.outputs:
        for token, top in zip(completion.token_ids, completion.logprobs):
            assert token in top and all(lp.logprob <= 0 for lp in top.values())
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    structured = SamplingParams(temperature=0, max_tokens=32, structured_outputs={"json": schema})
    text = llm.generate(["What is 2 + 2? Answer in JSON."], structured, use_tqdm=False)[0].outputs[0].text
    assert isinstance(json.loads(text)["answer"], int)


def test_unknown_quantization_is_refused_before_loading():
    with pytest.raises(ValueError, match="quantization must be one of None, 'int8', got 'int4'"):
        LLM("no/such/model", quantization="int4")


@pytest.mark.parametrize("widened", [False, True], ids=["direct", "widened"])
@pytest.mark.parametrize("isa", ops.supported_cpu_isas() or ["reference"])
def test_auto_dtype_is_bf16_around_int8_weights_on_every_tier(isa, widened, tiny_model_dirs):
    """Unquantized, "auto" is bf16 only on the avx512_bf16 tier, on AMX CPUs running an
    AVX-512 tier and on the avx2 tier with its widened bf16 kernel off (AMD's default), fp32
    elsewhere; with int8 weights it is bf16 on every tier; an explicit dtype stays as given."""
    settings = dict(device="cpu", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2)
    with ops.use_cpu_isa(isa) if isa != "reference" else contextlib.nullcontext(), ops.use_widened_panels(widened):
        amx = ops.amx_bf16_matmuls()
        plain = LLM(tiny_model_dirs["llama"], **settings).dtype
        int8 = LLM(tiny_model_dirs["llama"], quantization="int8", **settings).dtype
        fp32 = LLM(tiny_model_dirs["llama"], quantization="int8", dtype="float32", **settings).dtype
    direct_avx2 = isa == "avx2" and not widened
    assert plain == (torch.bfloat16 if isa == "avx512_bf16" or amx or direct_avx2 else torch.float32)
    assert int8 == torch.bfloat16
    assert fp32 == torch.float32


@pytest.mark.skipif(ops.BACKEND != "native", reason="the int8 kernels are in the C++ extension")
@pytest.mark.parametrize("kernel", int8_kernel_params())
def test_weights_are_quantized_in_the_block_their_kernel_runs_fastest(kernel, tiny_model_dirs):
    """64-input blocks under the AVX-512 VNNI kernel, Q8_0's 32 under the others (README,
    "8-bit weights"); a job's settings name the size, and the head and the lookup table share
    it. Under AVX2's kernel the layers but the head are narrow (|q| <= 64, stored q + 64), and
    the settings say so."""
    expected = 64 if kernel in ("avx512_vnni", AMX_INT8) else 32
    narrow = kernel == "avx2"
    with use_int8_kernel(kernel):
        llm = LLM(tiny_model_dirs["llama"], device="cpu", skip_tokenizer_init=True, max_model_len=64,
                  quantization="int8", quantize_embeddings=True)
    described = llm.engine.quantization.describe()  # as loaded, whichever kernel runs now
    model = llm.engine.runner.model
    head = model.tied_head_packed if model.lm_head is None else model.lm_head.packed_weight
    packed = [model.layers[0].self_attn.qkv_proj.packed_weight.data, head.data]
    assert [p.block for p in packed] == [expected, expected]
    assert model.embed_tokens.packed.block == expected
    assert described.startswith(f"int8 in {expected}-input blocks"), described
    qkv_values = int8_blocks.unpack_int8(packed[0]).values
    head_values = int8_blocks.unpack_int8(head.data).values
    assert [p.offset for p in packed] == [64 if narrow else 128, 128]
    assert int(qkv_values.abs().max()) == (64 if narrow else 127)
    assert int(head_values.abs().max()) == 127
    assert ("the layers but the LM head within +-64" in described) == narrow, described
