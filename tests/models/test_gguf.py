"""A GGUF file loads directly: config, tokenizer and EOS ids from the file, the demo model's
tokens as its converted directory's; Q8_0 linear layers run on the int8 kernels with the file's
own blocks; a tensor type or architecture we cannot serve, and a truncated file, are refused
by name before any work."""

import json

import gguf
import numpy as np
import pytest
import torch

from contbatch import LLM, SamplingParams, ops
from contbatch.cli import main
from contbatch.engine.tokenizer import load_tokenizer
from contbatch.models.config import ModelConfig
from contbatch.models.loader import read_config
from contbatch.ops import int8_blocks
from contbatch.ops.int8_blocks import Int8Blocks, unpack_int8
from tests.conftest import write_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SMALL = dict(dtype="float32", max_model_len=64, max_num_seqs=4)
MIXED_TENSOR = "blk.1.attn_v.weight"  # Q4_0 beside Q8_0 q and k: its fused layer loads densely
# Our fused linear layers -> the file's tensors they hold, in row order.
FILE_PIECES = {"self_attn.qkv_proj": ["attn_q", "attn_k", "attn_v"], "self_attn.o_proj": ["attn_output"],
               "mlp.gate_up_proj": ["ffn_gate", "ffn_up"], "mlp.down_proj": ["ffn_down"]}


@pytest.fixture(scope="module")
def demo_gguf_llm(smollm_gguf):
    return LLM(smollm_gguf, **SMALL)


@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory, smollm_gguf):
    """The demo model's first two layers and tokenizer, every matrix in Q8_0 but MIXED_TENSOR."""
    def stored_type(name: str, values: np.ndarray) -> str:
        if name == MIXED_TENSOR:
            return "Q4_0"
        return "Q8_0" if values.ndim == 2 else "F32"

    return write_gguf(smollm_gguf, tmp_path_factory.mktemp("q8_0") / "q8.gguf", 2, stored_type)


@pytest.fixture(scope="module")
def prompt_ids(smollm_dir) -> list[list[int]]:
    tokenizer = load_tokenizer(smollm_dir)
    return [tokenizer.encode(text) for text in PROMPTS]


def _greedy(llm: LLM, prompts: list) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_demo_gguf_reads_as_its_converted_directory(demo_gguf_llm, smollm_gguf, smollm_dir):
    assert read_config(smollm_gguf) == read_config(smollm_dir)
    directory_tokenizer = load_tokenizer(smollm_dir)
    tokenizer = demo_gguf_llm.get_tokenizer()
    text = "Hello world, 1234 — café!"
    assert tokenizer.encode(text) == directory_tokenizer.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    template = tokenizer.apply_chat_template(chat, tokenize=False)
    assert template == directory_tokenizer.apply_chat_template(chat, tokenize=False)
    assert demo_gguf_llm.engine.eos_token_ids == frozenset({2})


def test_demo_gguf_generates_its_converted_directorys_tokens(demo_gguf_llm, smollm_dir):
    """Both hold the same fp32 values (gguf-py dequantizes the Q4_1 and Q8_0 tensors for
    transformers' conversion as for us) and run the same kernels: the tokens are equal."""
    packed = demo_gguf_llm.engine.runner.model.layers[0].mlp.down_proj.packed_weight
    assert packed is None or packed.layout != "int8"  # Q4_1: dense (on a GPU, not packed at all)
    directory = LLM(smollm_dir, **SMALL)
    assert _greedy(demo_gguf_llm, PROMPTS) == _greedy(directory, PROMPTS)


def test_a_gguf_file_is_parsed_once_for_config_tokenizer_and_weights(q8_0_gguf, monkeypatch):
    """Each parse of the metadata takes seconds (a Python object per token)."""
    from contbatch.models import gguf as ours

    parsed = []
    real = gguf.GGUFReader

    def counting(path, *args, **kwargs):
        parsed.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    ours._open.cache_clear()
    llm = LLM(q8_0_gguf, **SMALL)
    assert parsed == [str(q8_0_gguf)]
    assert llm.get_tokenizer().encode("Hello world") and gguf.GGUFReader is counting


def _llama_cpp_permute(rows: torch.Tensor, heads: int) -> np.ndarray:
    """Hugging Face's q/k rows in llama.cpp's order (convert_hf_to_gguf.py, LlamaModel.permute)."""
    pairs = rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
    return pairs.swapaxes(1, 2).reshape(rows.shape).numpy()


def _file_blocks(reader: gguf.GGUFReader, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's (values int8 [rows, in], scales fp16 [rows, in / 32]) from its bytes:
    per block of 32, an fp16 scale then 32 int8 values."""
    (tensor,) = [t for t in reader.tensors if t.name == name]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    blocks = tensor.data.reshape(tensor.data.shape[0], -1, 34)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    return blocks[..., 2:].view(np.int8).reshape(blocks.shape[0], -1), scales


def _assert_file_blocks(ours: Int8Blocks, reader: gguf.GGUFReader, names: list[str], config: ModelConfig) -> None:
    """``ours`` holds the named Q8_0 tensors' values and scales, their rows one after another,
    q's and k's rows in Hugging Face's order."""
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    start = 0
    for name in names:
        values, scales = _file_blocks(reader, name)
        rows = slice(start, start + values.shape[0])
        our_values, our_scales = ours.values[rows], ours.scales[rows]
        kind = name.split(".")[2]
        if kind in heads:
            our_values, our_scales = (_llama_cpp_permute(t, heads[kind]) for t in (our_values, our_scales))
        np.testing.assert_array_equal(np.asarray(our_values), values)
        np.testing.assert_array_equal(np.asarray(our_scales), scales)
        start = rows.stop
    assert start == ours.values.shape[0]


def test_q8_0_layers_run_on_the_files_blocks(q8_0_gguf):
    # The int8 kernels are the CPU's: on a GPU, Q8_0 tensors load densely.
    model = LLM(q8_0_gguf, skip_tokenizer_init=True, device="cpu", **SMALL).engine.runner.model
    reader = gguf.GGUFReader(q8_0_gguf)
    for layer, module in enumerate(model.layers):
        for path, pieces in FILE_PIECES.items():
            packed = module.get_submodule(path).packed_weight
            if path == "self_attn.qkv_proj" and f"blk.{layer}.attn_v.weight" == MIXED_TENSOR:
                assert packed is None or packed.layout != "int8"
                continue
            assert packed.layout == "int8", f"layer {layer} {path}"
            names = [f"blk.{layer}.{piece}.weight" for piece in pieces]
            _assert_file_blocks(unpack_int8(packed.data), reader, names, model.config)
    (embedding,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    dequantized = torch.from_numpy(gguf.dequantize(embedding.data, embedding.tensor_type))
    assert torch.equal(model.embed_tokens.weight, dequantized)
    # The tied head runs on the Q8_0 table's own blocks, as llama.cpp runs it.
    assert model.tied_head_packed.layout == "int8"
    head, (values, scales) = unpack_int8(model.tied_head_packed.data), _file_blocks(reader, "token_embd.weight")
    np.testing.assert_array_equal(np.asarray(head.values), values)
    np.testing.assert_array_equal(np.asarray(head.scales), scales)


def _halve_embedding_values(name: str, data: np.ndarray) -> np.ndarray:
    """token_embd's int8 values halved, its scales kept: blocks whose largest value is far
    from 127, as quantizers other than gguf-py's leave them (ours would re-scale them)."""
    if name != "token_embd.weight":
        return data
    blocks = data.copy().reshape(data.shape[0], -1, 34)
    values = blocks[..., 2:].view(np.int8)
    values //= 2
    return blocks.reshape(data.shape)


def test_int8_lookup_and_head_keep_a_q8_0_tables_blocks(smollm_gguf, tmp_path):
    """quantization="int8" with quantize_embeddings: the lookup and the tied head hold the
    file's token_embd blocks as stored, not a re-quantization of their dequantized values."""
    path = write_gguf(smollm_gguf, tmp_path / "small_blocks.gguf", 1,
                      lambda name, values: "Q8_0" if values.ndim == 2 else "F32", _halve_embedding_values)
    model = LLM(path, quantization="int8", quantize_embeddings=True, skip_tokenizer_init=True,
                **SMALL).engine.runner.model
    assert model.embed_tokens.packed is model.tied_head_packed.data, "one int8 copy for both"
    values, scales = _file_blocks(gguf.GGUFReader(path), "token_embd.weight")
    assert np.abs(values).max() <= 64
    ours = unpack_int8(model.embed_tokens.packed)
    np.testing.assert_array_equal(np.asarray(ours.values), values)
    np.testing.assert_array_equal(np.asarray(ours.scales), scales)


def test_q8_0_gguf_runs_as_its_dequantized_copy_quantized_by_us(q8_0_gguf, tmp_path, prompt_ids, monkeypatch):
    """Q8_0 dequantizes exactly in fp32, and quantize_weight in Q8_0's 32-input blocks of a
    dequantized block gives its values and scale back when the block's largest |value| is
    127, as llama.cpp's quantizer makes it: so every int8 layer is the same, bit for bit,
    and so are the greedy tokens. The mixed layer is quantized by us on both sides; the LM
    head (tied) stays dense."""
    monkeypatch.setattr(ops, "int8_weight_block", lambda: int8_blocks.Q8_0_BLOCK)  # what quantization="int8" uses
    monkeypatch.setattr(ops, "int8_weight_qmax", lambda: int8_blocks.QMAX)  # all 8 bits, as llama.cpp's
    dequantized = write_gguf(q8_0_gguf, tmp_path / "f32.gguf", 2, lambda name, values: "F32")
    settings = dict(skip_tokenizer_init=True, quantization="int8", quantize_lm_head=False, **SMALL)
    direct, ours = LLM(q8_0_gguf, **settings), LLM(dequantized, **settings)
    linears = [(name, module) for name, module in direct.engine.runner.model.named_modules()
               if getattr(module, "packed_weight", None) is not None]
    assert len(linears) == 8
    for name, module in linears:
        theirs = ours.engine.runner.model.get_submodule(name).packed_weight
        assert module.packed_weight.layout == theirs.layout == "int8"
        a, b = unpack_int8(module.packed_weight.data), unpack_int8(theirs.data)
        assert torch.equal(a.values, b.values) and torch.equal(a.scales, b.scales), name
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    assert _greedy(direct, prompts) == _greedy(ours, prompts)


def _tiny_gguf(path, architecture: str, tensor: np.ndarray):
    writer = gguf.GGUFWriter(path, arch=architecture)
    writer.add_block_count(1)
    writer.add_tensor("blk.0.ffn_down.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_tensor_type_we_cannot_serve_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "int.gguf", "llama", np.ones((4, 32), dtype=np.int8))
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.ffn_down\.weight' in .*int\.gguf' is of type I8"):
        LLM(path, skip_tokenizer_init=True)


def test_an_architecture_we_cannot_map_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "mamba.gguf", "mamba", np.ones((4, 32), dtype=np.float32))
    with pytest.raises(ValueError, match=r"mamba\.gguf' holds a model of architecture 'mamba'.*supported: 'llama'"):
        LLM(path, skip_tokenizer_init=True)


@pytest.mark.parametrize("keep", [0.5, 0.001])  # cut in the tensor data, cut in the metadata
def test_truncated_gguf_is_named(q8_0_gguf, tmp_path, keep):
    data = q8_0_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"GGUF file '.*cut\.gguf' is truncated or not a GGUF file"):
        LLM(path, skip_tokenizer_init=True)


def test_model_impl_transformers_is_refused_for_gguf(q8_0_gguf):
    with pytest.raises(ValueError, match="is a GGUF file, which runs on contbatch's native models only"):
        LLM(q8_0_gguf, skip_tokenizer_init=True, model_impl="transformers")


def test_cli_generates_from_a_gguf_file(q8_0_gguf, tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": text}) + "\n" for i, text in enumerate(PROMPTS)))
    assert main(["generate", "-i", str(source), "-o", str(output), "-m", str(q8_0_gguf), "--dtype", "float32",
                 "--temperature", "0", "--max-tokens", "3", "--max-model-len", "64"]) == 0
    assert sorted(json.loads(line)["id"] for line in output.read_text().splitlines()) == [0, 1, 2]


@pytest.mark.skipif("avx2" not in ops.supported_cpu_isas(), reason="needs a tier where unquantized 'auto' is fp32")
def test_auto_dtype_is_bf16_for_a_gguf_with_q8_0_layers(q8_0_gguf, tmp_path):
    """On the avx2 tier with its widened bf16 kernel on (Intel's default), unquantized "auto" is fp32."""
    dense = write_gguf(q8_0_gguf, tmp_path / "f32.gguf", 2, lambda name, values: "F32")
    settings = dict(device="cpu", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2)
    with ops.use_cpu_isa("avx2"), ops.use_widened_panels(True):
        assert LLM(q8_0_gguf, **settings).dtype == torch.bfloat16
        assert LLM(dense, **settings).dtype == torch.float32
