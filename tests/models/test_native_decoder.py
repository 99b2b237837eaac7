"""The native decoder (csrc/cpu/decoder_stack.cpp) against the Python layers it stands in for:
the same tokens and bit-identical logprobs for every model it serves, in every dtype and in
int8; and the models and steps it leaves to the Python layers. (The HF oracle tests in
tests/test_generate_oracle.py run on it too, since it is the default.)"""

import pytest

from contbatch import LLM, SamplingParams, ops
from contbatch.layers import dense_prefill
from contbatch.models import native_decoder
from contbatch.models.llama import DecoderLayer
from tests.conftest import TINY_CONFIGS, save_random_model
from tests.test_generate_oracle import _tiny_prompts

# Skipped only without the extension: a built one that lacks the stack must fail these tests.
pytestmark = pytest.mark.skipif(ops.BACKEND != "native", reason="the C++ extension is not built")

SERVED = [*TINY_CONFIGS, "phi3-longrope", "phi4-mini-partial"]
SETTINGS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
            "int8": dict(dtype="bfloat16", quantization="int8")}


@pytest.fixture(scope="module")
def norm_model_dirs(tmp_path_factory) -> dict:
    """TINY_CONFIGS with random norm weights: a norm applied with another's weights shows."""
    return {
        name: save_random_model(make_config(), tmp_path_factory.mktemp(name), seed=7, norm_std=0.3)
        for name, make_config in TINY_CONFIGS.items()
    }


def _model_dir(arch, norm_model_dirs, phi3_gemma3_model_dirs):
    return norm_model_dirs[arch] if arch in norm_model_dirs else phi3_gemma3_model_dirs[arch]


def _generate(model_dir, monkeypatch, native: bool, prompts, max_tokens, **kwargs):
    """(token ids, logprobs) per prompt; chunked prefill and a shared prefix mix the steps."""
    monkeypatch.setenv("CONTBATCH_NATIVE_DECODER", "1" if native else "0")
    # The native decoder stack is a CPU path: on a machine with a GPU "auto" would take CUDA.
    llm = LLM(model_dir, skip_tokenizer_init=True,
              **{"device": "cpu", "max_num_seqs": 6, "max_num_batched_tokens": 32, **kwargs})
    assert (llm.engine.runner.model.native_decoder is not None) == native
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=3) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", SERVED)
def test_native_decoder_equals_python_layers(arch, setting, norm_model_dirs, phi3_gemma3_model_dirs, monkeypatch):
    model_dir = _model_dir(arch, norm_model_dirs, phi3_gemma3_model_dirs)
    prompts, max_tokens = _tiny_prompts()
    kwargs = dict(SETTINGS[setting], max_model_len=192)
    native = _generate(model_dir, monkeypatch, True, prompts, max_tokens, **kwargs)
    python = _generate(model_dir, monkeypatch, False, prompts, max_tokens, **kwargs)
    assert native == python


def test_a_class_the_extension_lacks_is_missing_not_an_error():
    """torch raises RuntimeError for an unregistered class: an extension built before
    DecoderStack existed must leave the models on their Python layers, not fail to load them."""
    assert native_decoder.extension_has_class("DecoderStack")
    assert not native_decoder.extension_has_class("NoSuchClass")


def test_gemma3_keeps_its_python_layers(phi3_gemma3_model_dirs):
    llm = LLM(phi3_gemma3_model_dirs["gemma3"], skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    assert model.native_decoder is None
    assert native_decoder.unsupported_reason(model) == "Gemma3ForCausalLM has its own decoder layers"


def test_long_prefill_runs_the_python_layers_and_decode_the_native_ones(tiny_model_dirs, monkeypatch):
    """A prefill with a query long enough for dense attention goes through the modules; the
    decode steps after it through the stack; the tokens are those of the modules alone."""
    calls = {"python": 0, "native": 0}
    layer_forward, stack_forward = DecoderLayer.forward, native_decoder.NativeDecoder.forward

    def counting(path, forward):
        def counted(*args, **kwargs):
            calls[path] += 1
            return forward(*args, **kwargs)
        return counted

    monkeypatch.setattr(DecoderLayer, "forward", counting("python", layer_forward))
    monkeypatch.setattr(native_decoder.NativeDecoder, "forward", counting("native", stack_forward))
    monkeypatch.setattr(dense_prefill, "MIN_QUERY_ROWS", 64)  # the tiny model's context is 512
    monkeypatch.setattr(dense_prefill, "PAGED_LONG_CHUNK_TIERS", frozenset())  # sdpa on every tier
    prompt = [3 + i % 90 for i in range(100)]
    kwargs = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=128)
    native = _generate(tiny_model_dirs["llama"], monkeypatch, True, [prompt], [8], **kwargs)
    assert calls == {"python": 2, "native": 7}  # 2 layers once; 7 decode steps after the first token
    python = _generate(tiny_model_dirs["llama"], monkeypatch, False, [prompt], [8], **kwargs)
    assert native == python
