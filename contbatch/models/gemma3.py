"""Gemma 3 text (Gemma3ForCausalLM): the Llama layers with Gemma's differences.

- embeddings scaled by sqrt(hidden_size), in the model's dtype;
- RMSNorms scaling by (1 + weight), and four per layer: before and after attention, before
  and after the MLP (the "after" ones normalise a branch's output before the residual add);
- q/k RMSNorm per head, attention scale query_pre_attn_scalar**-0.5;
- a GeGLU MLP (gelu_pytorch_tanh), chosen by the config's hidden_act;
- sliding-window layers with their own rope base (local_rope_theta) between global layers
  with rope_theta and rope_scaling, per ``layer_types``;
- a tied head, its logits softcapped when final_logit_softcapping is set.
"""

import torch
from torch import nn

from contbatch.config import Quantization
from contbatch.layers.norm import GemmaRMSNorm
from contbatch.layers.rotary import RotaryEmbedding
from contbatch.models.config import ModelConfig
from contbatch.models.llama import DecoderLayer, LlamaForCausalLM
from contbatch.ops.int8_blocks import Int8Blocks


class Gemma3DecoderLayer(DecoderLayer):
    """Norms after attention and after the MLP too: each branch's output is normalised before
    its residual add, and the MLP has a pre-norm of its own."""

    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.is_sliding = config.layer_types[layer] == "sliding_attention"
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def feed_forward(self, attention_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normalised MLP output, the residual stream with the normalised attention_out
        added): as in the Llama layer, each add is fused into the next pre-norm."""
        hidden = self.post_attention_layernorm(attention_out)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.local_rotary: RotaryEmbedding | None = None

    def pack_weights(self, quantization: Quantization | None = None, embedding_blocks: Int8Blocks | None = None) -> None:
        """After loading: fold the 1 into every norm's weight, then pack as Llama does."""
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.fold_one()
        super().pack_weights(quantization, embedding_blocks)

    def init_rotary(self, max_positions: int) -> None:
        super().init_rotary(max_positions)
        self.local_rotary = self.rotary_table(
            max_positions, self.config.local_rope_theta, self.config.local_rope_scaling
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers rounds sqrt(hidden_size) to fp32, then to the model's dtype, and multiplies there.
        return hidden.mul_(torch.tensor(self.config.hidden_size**0.5).to(hidden.dtype))

    def rotary_for(self, layer: nn.Module) -> RotaryEmbedding:
        return self.local_rotary if layer.is_sliding else self.rotary

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
