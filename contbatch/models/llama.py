"""The Llama decoder family: Llama (2, 3, 3.1 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm),
Phi-3 (LongRoPE, partial rotary; its checkpoints fuse the projections already).

All take a flattened varlen batch ``[num_tokens]`` with no padding. Q/K/V and
gate/up projections are fused into one matmul each; the weight loader fills the
fused matrices from the checkpoint's separate tensors.
"""

from collections.abc import Sequence

import torch
from torch import nn

from contbatch.config import Quantization
from contbatch.layers.activation import GATED_ACTIVATIONS
from contbatch.layers.attention import AttentionMetadata, KVCache, PagedAttention
from contbatch.layers.embedding import Int8Embedding
from contbatch.layers.linear import (
    Linear,
    PackedWeight,
    int8_packed,
    pack_linears,
    pack_weight,
    packed_linear,
    quantize_linears,
)
from contbatch.layers.norm import RMSNorm
from contbatch.layers.rotary import RotaryEmbedding
from contbatch.lora.layers import StepAdapters
from contbatch.layers.huge_pages import move_to_huge_pages, packed_tensors
from contbatch.models import native_decoder
from contbatch.models.config import ModelConfig
from contbatch.ops.int8_blocks import Int8Blocks, quantize_weight


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, norm: type[RMSNorm] = RMSNorm) -> None:
        """``norm``: the class of the q/k norms, if the config has them."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, config.layer_window(layer),
                                   config.attention_scale)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # One view and split_with_sizes: the same strided views as splitting the columns and
        # viewing each, in half the Python time (~5 us a layer, a decode step's overhead).
        heads = self.qkv_proj(hidden).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split_with_sizes([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_and_mul = GATED_ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(hidden)))


class DecoderLayer(nn.Module):
    norm_class: type[RMSNorm] = RMSNorm  # of every norm in the layer (and the model's final one)

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, self.norm_class)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added): the
        add is fused into the next norm, so each residual add costs no pass of its own."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        return self.feed_forward(self.self_attn(hidden, positions, rotary, kv_cache, metadata), residual)

    def feed_forward(self, attention_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream with attention_out added)."""
        hidden, residual = self.post_attention_layernorm.add_and_norm(attention_out, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral, Qwen2, Qwen3 and Phi-3: their differences are config switches.

    A subclass may swap the decoder layer class, and override ``embed`` and ``rotary_for``
    (contbatch/models/gemma3.py)."""

    decoder_layer: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, layer) for layer in range(config.num_layers))
        self.norm = self.decoder_layer.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.tied_head_packed: PackedWeight | None = None  # the embedding matrix packed as the LM head
        self.native_decoder: native_decoder.NativeDecoder | None = None  # the layers in C++, once packed
        self.step_adapters: StepAdapters | None = None  # with LoRA: which rows run which adapter (contbatch/lora)

    def pack_weights(self, quantization: Quantization | None = None, embedding_blocks: Int8Blocks | None = None) -> None:
        """After loading: lay every projection (and a tied LM head) out for a fast CPU kernel,
        in 8-bit blocks where ``quantization`` says so. ``embedding_blocks``: the embedding
        table already in 8-bit blocks (a GGUF file's Q8_0 ``token_embd``), used as they are
        wherever the table is needed in int8; without ``quantization`` a tied head takes them."""
        if quantization is not None:
            quantize_linears(self, quantization, head=self.lm_head)
        pack_linears(self)
        embedding = self.embed_tokens.weight
        tied = self.lm_head is None
        int8_head = tied and (quantization.lm_head if quantization is not None else embedding_blocks is not None)
        int8_lookup = quantization is not None and quantization.embeddings
        int8_table = None  # one int8 copy of the table serves both a tied head and the lookup
        if int8_head or int8_lookup:
            int8_table = int8_packed(
                embedding_blocks if embedding_blocks is not None else quantize_weight(embedding, quantization.block)
            )
        if tied:
            self.tied_head_packed = int8_table if int8_head else pack_weight(embedding)
        if int8_lookup:
            self.embed_tokens = Int8Embedding(int8_table.data, embedding.dtype)
        move_to_huge_pages(packed_tensors(self))
        if native_decoder.enabled() and native_decoder.unsupported_reason(self) is None:
            self.native_decoder = native_decoder.NativeDecoder(self)

    def init_rotary(self, max_positions: int) -> None:
        """Build the cos/sin tables once the weights are materialised (they are not parameters)."""
        self.rotary = self.rotary_table(max_positions, self.config.rope_theta, self.config.rope_scaling)

    def rotary_table(self, max_positions: int, base: float, scaling: dict | None) -> RotaryEmbedding:
        weight = self.embed_tokens.weight
        return RotaryEmbedding(
            self.config.rotary_dim, max_positions, base, scaling, dtype=weight.dtype, device=weight.device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] of a flattened varlen batch; ``kv_caches`` and
        ``metadata`` (block tables and slots of the layer's KV-cache group) per layer."""
        hidden, residual = self.embed(input_ids), None
        adapted = self.step_adapters is not None and self.step_adapters.active  # the C++ layers have no LoRA
        if self.native_decoder is not None and not adapted and self.native_decoder.serves(hidden, metadata):
            return self.native_decoder.forward(hidden, positions, kv_caches, metadata)
        for layer, kv_cache, layer_metadata in zip(self.layers, kv_caches, metadata):
            hidden, residual = layer(hidden, residual, positions, self.rotary_for(layer), kv_cache, layer_metadata)
        return self.norm.add_and_norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rotary_for(self, layer: nn.Module) -> RotaryEmbedding:
        return self.rotary

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.tied_head_packed is not None:
            return packed_linear(hidden, self.tied_head_packed, None)
        return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
