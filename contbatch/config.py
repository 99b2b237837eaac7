"""EngineConfig: every engine knob in one validated dataclass."""

import logging
from dataclasses import dataclass

import torch

from contbatch import ops
from contbatch.ops.int8_blocks import QMAX
from contbatch.sampling_params import MAX_SEED

_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

MODEL_IMPLS = ("auto", "native", "transformers")
QUANTIZATIONS = (None, "int8")
KV_CACHE_DTYPES = ("auto", "int8")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quantization:
    """Which weights a model keeps quantized, and how (EngineConfig.quantization_spec)."""

    method: str  # "int8"
    lm_head: bool
    embeddings: bool
    block: int  # inputs a block of the weights it quantizes (ops.int8_weight_block)
    qmax: int = QMAX  # the largest |q| of the linear layers but the LM head (ops.int8_weight_qmax)

    def describe(self) -> str:
        """As a job's settings file records it: the block size and narrow weights are named,
        so that a job begun with 32-input blocks (before 2026-11-27, or on another int8
        kernel) does not resume with 64 unawares, nor one begun with all 8 bits (before
        2026-12-03, or on another kernel) with narrow weights."""
        def kind(quantized: bool) -> str:
            return self.method if quantized else "dense"

        narrow = "" if self.qmax == QMAX else f", the layers but the LM head within +-{self.qmax}"
        return (f"{self.method} in {self.block}-input blocks{narrow}, LM head {kind(self.lm_head)}, "
                f"embeddings {kind(self.embeddings)}")


@dataclass
class EngineConfig:
    """Engine settings. Values of None are filled in from the model and the machine.

    Attributes:
        max_num_seqs: most requests running in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: longest prompt + completion; defaults to the model's context length.
        block_size: tokens per KV-cache block; None: the attention backend's default
            (contbatch/engine/kv_cache.py: 16, or 256 on CUDA with flash-attn).
        kv_cache_memory: bytes for the KV cache; default sized from available RAM.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        seed: seeds the sampler for requests without their own seed.
        adapt_threads: on the CPU, use only the cores other processes leave free, checked
            four times a second (contbatch/engine/threads.py); False keeps torch's thread count.
        model_impl: which code runs the model (contbatch/models/loader.py): "native"
            (contbatch's own Llama-family model), "transformers" (transformers' modeling code
            on contbatch's paged attention), or "auto" (native where it can, else transformers).
        quantization: None (weights in the model dtype) or "int8": linear layers' weights in
            8-bit blocks by llama.cpp's Q8_0 rule, 64 inputs a block on the avx512_vnni int8
            kernel and 32 elsewhere (ops.int8_weight_block), activations quantized per token
            in the same blocks (contbatch/ops/int8_blocks.py); on the avx2 int8 kernel the
            layers but the LM head within +-64 (ops.int8_weight_qmax). CPU only.
        quantize_lm_head: with quantization, quantize the LM head too.
        quantize_embeddings: with quantization, keep the embedding table in 8-bit blocks too
            (rows dequantized on lookup); a tied LM head then shares that one int8 copy.
        kv_cache_dtype: "auto" (the KV cache in the model dtype) or "int8": each token's K
            and V rows of each kv head in 8 bits with one fp32 scale (docs/design/kv_cache_layout.md),
            about half the bytes of bf16 and a quarter of fp32. CPU only.
        enable_lora: serve LoRA adapters that requests name (``lora_request``; contbatch/lora).
        max_loras: the most adapters the requests running in one step use between them (as
            vLLM's); a request of another adapter waits until one of them has no request left.
        max_lora_rank: the highest adapter rank accepted.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    adapt_threads: bool = True
    model_impl: str = "auto"
    quantization: str | None = None
    quantize_lm_head: bool = True
    quantize_embeddings: bool = False
    kv_cache_dtype: str = "auto"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.block_size is not None:
            _check_positive("block_size", self.block_size)
        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None:
            _check_positive("kv_cache_memory", self.kv_cache_memory)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int in [0, 2**64 - 1], got {self.seed!r}")
        if not 0 <= self.seed <= MAX_SEED:  # torch.Generator's range, as SamplingParams.seed
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed!r}")
        _check_positive("max_loras", self.max_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        for name in ("enable_prefix_caching", "adapt_threads", "quantize_lm_head", "quantize_embeddings", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.model_impl, str) or self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(map(repr, MODEL_IMPLS))}, got {self.model_impl!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATIONS))}, got {self.quantization!r}")
        if self.quantization is None and (self.quantize_embeddings or not self.quantize_lm_head):
            given = "quantize_embeddings=True" if self.quantize_embeddings else "quantize_lm_head=False"
            raise ValueError(f"{given} applies only with quantization='int8' (it would be ignored without it)")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = ("; vLLM's fp8 caches have no kernels here, 'int8' is the 8-bit one"
                    if str(self.kv_cache_dtype).startswith("fp8") else "")
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}{hint}")

    def cpu_only_settings(self) -> str | None:
        """The settings given that run on the CPU only (for resolve_device), or None."""
        names = []
        if self.quantization is not None:
            names.append(f"quantization={self.quantization!r}")
        if self.kv_cache_dtype != "auto":
            names.append(f"kv_cache_dtype={self.kv_cache_dtype!r}")
        return " and ".join(names) or None

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache tensor's dtype: the model's, or torch.int8 with kv_cache_dtype="int8"."""
        return torch.int8 if self.kv_cache_dtype == "int8" else model_dtype

    def quantization_spec(self) -> Quantization | None:
        if self.quantization is None:
            return None
        return Quantization(self.quantization, self.quantize_lm_head, self.quantize_embeddings, ops.int8_weight_block(),
                            ops.int8_weight_qmax())


def resolve_device(device: str | torch.device, cpu_only: str | None = None) -> torch.device:
    """"auto" picks CUDA when a GPU is visible, else the CPU. ``cpu_only`` names a setting
    that runs on the CPU only (int8 weights, an int8 KV cache): "auto" then picks the CPU, saying why
    when a GPU is visible, and an explicit CUDA device is refused, naming the setting."""
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        if cpu_only is not None:
            logger.warning("device='auto' chose the CPU though a GPU is visible: %s has CPU kernels only", cpu_only)
            return torch.device("cpu")
        return torch.device("cuda")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is available to this torch build")
    if resolved.type == "cuda" and cpu_only is not None:
        raise ValueError(f"device={device!r}: {cpu_only} has CPU kernels only (no CUDA version); "
                         "use device='cpu' or 'auto'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, int8_weights: bool = False) -> torch.dtype:
    """"auto" is bf16 where the hardware does bf16 natively, else fp32 (CPU) or fp16 (old GPUs);
    on the CPU also bf16 wherever the linear weights are int8 (``int8_weights``: see
    cpu_serves_bf16)."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
        resolved = _DTYPES[dtype]
    elif dtype in (torch.float32, torch.bfloat16, torch.float16):
        resolved = dtype
    else:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
    if resolved is None:
        return _auto_dtype(device, int8_weights)
    if resolved == torch.float16 and device.type == "cpu":
        raise ValueError(
            "dtype=float16 is refused on CPU: CPU fp16 matmuls are ~300x slower than bf16. "
            "Use dtype='bfloat16' (or 'auto') or 'float32'."
        )
    return resolved


def _auto_dtype(device: torch.device, int8_weights: bool) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if int8_weights or cpu_serves_bf16() else torch.float32


def cpu_serves_bf16() -> bool:
    """Whether bf16 is the faster CPU dtype for batched generation. Measured on chat256
    (docs/performance.md): bf16 wins where the kernels run the avx512_bf16 tier, whose
    vdpbf16ps does twice an FMA's work (Zen 4: 578 against 276 output tok/s), and on CPUs
    with AMX, whose bf16 linears of many rows run in AMX tiles (ops.amx_bf16_matmuls;
    Emerald Rapids: 844 against 313 for fp32), and on the avx2 tier where its bf16 linear
    widens each weight in the loop (AMD: ops.widened_bf16_panels() is off): with half the
    bytes it runs the linears 1.4-2.5x faster than oneDNN's fp32 up to 16 rows and at
    0.8-0.98x from 64 (Zen 3, benchmarks/linear.py, two sessions), and chat256 faster (165.8
    against 146.9). On
    Intel CPUs without AMX bf16 still halves the bytes a decode step reads (1.3-1.7x faster
    steps with few requests running), but fp32 matmuls are faster at the many-request steps
    that dominate a large batch (Emerald Rapids without AMX: fp32 346 against 316 tok/s for
    bf16; its AVX2 tier: 238 against 202), so "auto" is fp32 there; pass dtype="bfloat16"
    for small batches.
    Without the extension, CPUs with native bf16 matmuls (AVX512_BF16 or AMX, through oneDNN)
    take bf16.

    With int8 linear weights the matmuls are int8 whatever the dtype, so the rest (attention,
    norms, the KV cache) is cheaper in bf16 on every tier: chat256 with int8 weights ran
    faster with bf16 than with fp32 around them on each CPU measured (Emerald Rapids 630.9
    against 529.2 output tok/s; Zen 5 with the AVX2 tier forced 522.8 against 482.8 in runs
    beside fp32 at 396.0 and 398.2), at +0.65% perplexity against the fp32 model (+0.56%
    with fp32 around the int8 matmuls)."""
    if ops.cpu_isa() is not None:
        direct_avx2 = ops.cpu_isa() == "avx2" and not ops.widened_bf16_panels()
        return ops.cpu_isa() == "avx512_bf16" or ops.amx_bf16_matmuls() or direct_avx2
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and _cpu_flags_have_bf16()
    except (AttributeError, RuntimeError):
        return False


def _cpu_flags_have_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
