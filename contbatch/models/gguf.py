"""Read a GGUF file (llama.cpp's format): its config, its tensors under Hugging Face
checkpoint names, and the token ids it ends generation on.

transformers reads the metadata into a config dict (and the tokenizer: engine/tokenizer.py),
gguf-py names each tensor's Hugging Face counterpart and dequantizes, and transformers'
tensor processor undoes the row permutation llama.cpp's converter applies to Llama's q and k.
Q8_0 tensors are 8-bit blocks of 32 inputs with an fp16 scale, the int8 kernels' own format
(contbatch/ops/int8_blocks.py): they come out as ``Int8Blocks`` holding the file's bytes,
never through a dense dtype. Needs the ``gguf`` package (``pip install contbatch[gguf]``).
"""

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig
from transformers import modeling_gguf_pytorch_utils as hf_gguf

from contbatch.models.config import ModelConfig, parse_model_config
from contbatch.ops.int8_blocks import Q8_0_BLOCK, Int8Blocks

try:
    import gguf as gguf_py
except ImportError:  # an optional dependency: only GGUF files need it
    gguf_py = None

# GGUF general.architecture -> the native model that runs it. llama.cpp files Llama, Mistral
# and SmolLM alike as "llama".
ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK  # an fp16 scale, then 32 int8 values
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def is_gguf_file(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def has_q8_0_layers(path: Path) -> bool:
    """Whether the file's layers hold Q8_0 tensors (which the CPU runs on its int8 kernels);
    reads the metadata only."""
    return any(_is_q8_0(tensor.tensor_type) and tensor.name.startswith("blk.") for tensor in _reader(path).tensors)


def read_gguf_config(path: Path) -> ModelConfig:
    """The config of a GGUF file's model: the one the Hugging Face directory converted from
    it would give. ValueError naming the file when it is unreadable, of an architecture we
    have no mapping for, or holds a tensor we cannot serve; no tensor is read."""
    reader = _reader(path)
    architecture = _architecture(reader, path)
    _check_tensor_types(reader, path)
    _check_rope(reader, architecture, path)
    with parsed_once(path):
        raw = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    # transformers makes a "llama" file whose name says Mistral a MistralConfig (a 4096-token
    # sliding window by default); llama.cpp runs every such file as Llama, and so do we.
    raw["model_type"] = architecture
    raw = AutoConfig.for_model(**raw).to_dict()
    raw["architectures"] = [ARCHITECTURES[architecture]]
    return parse_model_config(raw, (ARCHITECTURES[architecture],), path)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, read when asked for, its rows in Hugging Face's order."""

    name: str  # the file's name for it, e.g. "blk.0.attn_q.weight"
    data: np.ndarray  # gguf-py's memory-mapped data: bytes [rows, row bytes] for block types
    tensor_type: "gguf_py.GGMLQuantizationType"
    reorder: Callable[[np.ndarray], np.ndarray]  # rows into Hugging Face's order

    @property
    def is_q8_0(self) -> bool:
        return _is_q8_0(self.tensor_type)

    def dense(self) -> torch.Tensor:
        """The values in fp32 (exact for Q8_0: an int8 times an fp16 fits fp32's mantissa)."""
        return _to_torch(self.reorder(gguf_py.dequantize(self.data, self.tensor_type)))

    def int8_blocks(self) -> Int8Blocks:
        """A Q8_0 matrix as the int8 kernels' blocks: the file's values and scales, whose rows
        reorder together (a row permutation moves each row's blocks whole)."""
        rows, row_bytes = self.data.shape
        blocks = self.data.reshape(rows, row_bytes // _Q8_0_BLOCK_BYTES, _Q8_0_BLOCK_BYTES)
        scales = blocks[..., :2].view(np.float16)[..., 0]
        values = blocks[..., 2:].view(np.int8).reshape(rows, -1)
        return Int8Blocks(_to_torch(self.reorder(values)), _to_torch(self.reorder(scales)), values.shape[1])


def gguf_tensors(path: Path, config: ModelConfig, checkpoint_names: Iterable[str]) -> dict[str, GGUFTensor]:
    """The file's tensors by the Hugging Face checkpoint names they stand for (among
    ``checkpoint_names``, those the model takes); ValueError for a tensor that has no place."""
    reader = _reader(path)
    architecture = _architecture(reader, path)
    gguf_arch = next(key for key, name in gguf_py.MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = gguf_py.get_tensor_name_map(gguf_arch, config.num_layers)
    by_file_name = {name_map.get_name(name, try_suffixes=(".weight", ".bias")): name for name in checkpoint_names}
    # For the architectures above the processor only reorders rows (Llama's q and k).
    heads = {"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads}
    processor = hf_gguf.TENSOR_PROCESSORS.get(architecture, hf_gguf.TensorProcessor)(config=heads)
    tensors = {}
    for tensor in reader.tensors:
        name = by_file_name.get(tensor.name)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {str(path)!r} has no place in {config.architecture}")
        reorder = functools.partial(_reorder, processor, tensor.name)
        tensors[name] = GGUFTensor(tensor.name, tensor.data, tensor.tensor_type, reorder)
    return tensors


def gguf_eos_token_ids(path: Path) -> set[int]:
    """The ids llama.cpp ends generation on that the file names: end of sequence, of turn, of message."""
    return {int(value) for key in _EOS_KEYS for value in gguf_metadata(path, key)}


def gguf_metadata(path: Path, key: str) -> list:
    """The values of one metadata field of the file (empty where it has none)."""
    return list(hf_gguf.read_field(_reader(path), key))


def _reader(path: Path) -> "gguf_py.GGUFReader":
    if gguf_py is None:
        raise ImportError(f"reading the GGUF file {str(path)!r} needs the gguf package: pip install contbatch[gguf]")
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    return _open(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _open(path: Path, mtime_ns: int, size: int) -> "gguf_py.GGUFReader":
    """Parsing a GGUF file's metadata takes seconds (a Python object per token) and config,
    weights and EOS ids each need it: the last file parsed is kept while it is unchanged."""
    del mtime_ns, size  # in the cache key only
    try:
        return gguf_py.GGUFReader(path)
    except (ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"GGUF file {str(path)!r} is truncated or not a GGUF file ({exc}); "
                         "download or convert it again") from None


@contextmanager
def parsed_once(path: Path) -> Iterator[None]:
    """Inside it, transformers' GGUF loading (config, tokenizer) reads ``path`` through the
    reader this process has parsed already, instead of parsing the file again (seconds each:
    a Python object per token). transformers looks ``gguf.GGUFReader`` up as it loads, so it
    is swapped for the duration; other files still get a reader of their own."""
    parsed, real, target = _reader(path), gguf_py.GGUFReader, path.resolve()

    def reader_for(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == target:
            return parsed
        return real(file, *args, **kwargs)

    gguf_py.GGUFReader = reader_for
    try:
        yield
    finally:
        gguf_py.GGUFReader = real


def _architecture(reader: "gguf_py.GGUFReader", path: Path) -> str:
    architecture = next(iter(hf_gguf.read_field(reader, "general.architecture")), None)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"GGUF file {str(path)!r} holds a model of architecture {architecture!r}, which "
                         f"contbatch cannot map to its models; supported: {', '.join(map(repr, ARCHITECTURES))}")
    return architecture


def _check_tensor_types(reader: "gguf_py.GGUFReader", path: Path) -> None:
    for tensor in reader.tensors:
        if not _can_dequantize(tensor.tensor_type):
            raise ValueError(f"GGUF tensor {tensor.name!r} in {str(path)!r} is of type {tensor.tensor_type.name}, "
                             "which contbatch cannot serve; it reads Q8_0 (into the int8 kernels) and the types "
                             "gguf-py dequantizes (F32, F16, BF16, Q4_0 to Q6_K, IQ*, ...)")


def _is_q8_0(tensor_type: "gguf_py.GGMLQuantizationType") -> bool:
    """Q8_0: the int8 kernels' own block format (module docstring)."""
    return tensor_type.name == "Q8_0"


@functools.cache
def _can_dequantize(tensor_type: "gguf_py.GGMLQuantizationType") -> bool:
    """Whether gguf-py dequantizes ``tensor_type`` (tried on one block of zeros)."""
    _, block_bytes = gguf_py.GGML_QUANT_SIZES[tensor_type]
    try:
        gguf_py.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def _check_rope(reader: "gguf_py.GGUFReader", architecture: str, path: Path) -> None:
    """Refuse rope scaling the config dict would silently drop (transformers maps none of it for Llama)."""
    scaling = next(iter(hf_gguf.read_field(reader, f"{architecture}.rope.scaling.type")), "none")
    if scaling != "none":
        raise ValueError(f"GGUF file {str(path)!r} scales rope ({architecture}.rope.scaling.type={scaling!r}), "
                         "which contbatch does not read from GGUF files")
    if any(tensor.name == "rope_freqs.weight" for tensor in reader.tensors):
        raise ValueError(f"GGUF file {str(path)!r} scales rope by a rope_freqs tensor (Llama 3.1 and later), "
                         "which contbatch does not read from GGUF files")


def _reorder(processor: hf_gguf.TensorProcessor, name: str, weights: np.ndarray) -> np.ndarray:
    return processor.process(weights=weights, name=name).weights


def _to_torch(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))  # a copy: the file's memory map is read-only
