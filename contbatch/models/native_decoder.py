"""The Llama family's decoder layers in one C++ call per forward, on the CPU.

``NativeDecoder`` hands a loaded, packed ``LlamaForCausalLM``'s layers to the extension's
``DecoderStack`` (csrc/cpu/decoder_stack.cpp), which runs them with the same ops, in the same
order, as the Python modules of contbatch/models/llama.py: the results are bit for bit those
of the modules. What it saves is Python: with few tokens a step, module calls, op dispatch
and views took about as long as the kernels (SmolLM2 decoding on a Zen 5: ~60 us a layer;
docs/design/experiments.md).

The modules stay the path for everything it does not serve: prefill steps long enough for
dense_prefill (their Python is noise beside their matmuls), models or weights it has no case
for (``unsupported_reason``), the reference ops, and devices other than the CPU.
``CONTBATCH_NATIVE_DECODER=0`` turns it off, to compare the two.
"""

import os
from collections.abc import Sequence

import torch

from contbatch import ops
from contbatch.layers import dense_prefill
from contbatch.layers.activation import silu_and_mul
from contbatch.layers.attention import AttentionMetadata, KVCache
from contbatch.layers.linear import Linear
from contbatch.layers.norm import RMSNorm
from contbatch.ops.int8_blocks import WEIGHT_OFFSET

_LAYOUTS = ("panels", "int8", "onednn")


def enabled() -> bool:
    """Whether new models get a native decoder: the extension has one and the environment allows it."""
    if os.environ.get("CONTBATCH_NATIVE_DECODER", "1") == "0" or ops.BACKEND != "native":
        return False
    return extension_has_class("DecoderStack")


def extension_has_class(name: str) -> bool:
    """Whether the built extension registers ``torch.classes.contbatch.<name>``: one built before
    the class existed (an editable install pulled but not rebuilt) runs the modules instead."""
    try:
        getattr(torch.classes.contbatch, name)
    except (AttributeError, RuntimeError):  # torch raises RuntimeError for a class it lacks
        return False
    return True


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` (a packed LlamaForCausalLM or subclass) cannot run natively; None if it can."""
    from contbatch.models.llama import DecoderLayer, LlamaForCausalLM  # llama.py imports this module

    cls = type(model)
    if cls.decoder_layer is not DecoderLayer or cls.rotary_for is not LlamaForCausalLM.rotary_for:
        return f"{cls.__name__} has its own decoder layers"
    if model.rotary is None:
        return "the rotary tables are not built"
    for layer in model.layers:
        if layer.mlp.act_and_mul is not silu_and_mul:
            return "the MLP's activation is not SiLU"
        norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm)
        if any(norm is not None and type(norm) is not RMSNorm for norm in norms):
            return "a norm is not RMSNorm"
        for linear in _linears(layer):
            packed = linear.packed_weight
            if packed is None or packed.layout not in _LAYOUTS:
                return "a projection is not packed for a CPU kernel"
    return None


def _linears(layer: torch.nn.Module) -> tuple[Linear, Linear, Linear, Linear]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _native_linear(linear: Linear) -> torch.ScriptObject:
    packed = linear.packed_weight
    scales = None
    data = packed.data
    weight_offset = WEIGHT_OFFSET  # read by the int8 layout only
    if packed.layout == "int8":
        data, scales, weight_offset = packed.data.values, packed.data.scales, packed.data.offset
    return torch.classes.contbatch.PackedLinear(packed.layout, data, scales, linear.bias, packed.out_features,
                                                weight_offset)


class NativeDecoder:
    """The decoder layers and final norm of one model, run by ``DecoderStack``."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        attention = model.layers[0].self_attn
        self._stack = torch.classes.contbatch.DecoderStack(
            config.num_heads, config.num_kv_heads, config.head_dim, model.rotary.rotary_dim, config.rms_norm_eps,
            attention.attn.scale, model.rotary.cos, model.rotary.sin, model.norm.weight,
        )
        for layer in model.layers:
            attn = layer.self_attn
            q_norm = None if attn.q_norm is None else attn.q_norm.weight
            k_norm = None if attn.k_norm is None else attn.k_norm.weight
            self._stack.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, q_norm, k_norm,
                attn.attn.sliding_window, *(_native_linear(linear) for linear in _linears(layer)),
            )
        self._bound_caches: list[KVCache] | None = None

    def serves(self, hidden: torch.Tensor, metadata: Sequence[AttentionMetadata]) -> bool:
        """False for a step the Python layers must run: one that attends densely (long queries),
        or whose layers are in more than one KV-cache group (sliding and global layers)."""
        first = metadata[0]
        return (
            hidden.is_cpu
            and not dense_prefill.has_long_queries(hidden, first.max_query_len)
            and all(m is first for m in metadata)
        )

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
        metadata: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """The final norm's output for the embedded tokens ``hidden``, as LlamaForCausalLM.forward."""
        if kv_caches is not self._bound_caches:  # the runner allocates its caches once
            self._stack.bind_caches([k for k, _ in kv_caches], [v for _, v in kv_caches])
            self._bound_caches = kv_caches
        m = metadata[0]
        return self._stack.forward(hidden, positions, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc)
