"""The transformers path: any decoder-only model transformers can load, on contbatch's paged KV cache.

transformers' own modeling code runs the model; only attention is ours
(contbatch/models/transformers_attention.py). The batch is the runner's flat varlen batch
as one row ``[1, num_tokens]``, with each token's position in its own sequence: no padding,
no mask tensor, no HF cache. The model offers the runner what a native model does:
``forward(input_ids, positions, kv_caches, metadata)`` (both per layer) returns hidden states, and
``compute_logits`` turns the rows the runner picks into logits with the model's own head code.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import ModelOutput

from contbatch.config import Quantization
from contbatch.layers.attention import AttentionMetadata, KVCache, PagedAttention
from contbatch.layers.embedding import Int8Embedding
from contbatch.layers.linear import Linear, int8_quantized, pack_linears, quantize_linears
from contbatch.layers.huge_pages import move_to_huge_pages, packed_tensors
from contbatch.models.transformers_attention import ATTENTION_NAME, PagedStep, register_paged_attention
from contbatch.models.transformers_config import TransformersModelConfig

_PROBE_BLOCK_SIZE = 16


@dataclass
class _HiddenStatesOnly(ModelOutput):
    last_hidden_state: torch.Tensor | None = None

    def __getattr__(self, name: str) -> None:
        # A causal-LM head copies the stack's other outputs into its own (cache, attentions,
        # GPT-2's cross_attentions); here there are none.
        if name.startswith("_"):
            raise AttributeError(name)
        return None


class _GivenHiddenStates(nn.Module):
    """Stands in for the transformer stack inside the causal-LM class, so that ``compute_logits``
    runs transformers' own head code on hidden states the step already computed: heads differ
    after the LM head (Granite divides by logits_scaling, HyperCLOVA X multiplies by it, Gemma
    softcaps, Cohere scales), and the model's own code is the one that knows."""

    def forward(self, *args, inputs_embeds: torch.Tensor, **kwargs) -> _HiddenStatesOnly:
        return _HiddenStatesOnly(last_hidden_state=inputs_embeds)


class TransformersCausalLM(nn.Module):
    """A transformers causal LM behind the interface the model runner expects of a native model."""

    def __init__(self, causal_lm: PreTrainedModel, config: TransformersModelConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = causal_lm.base_model
        # forward() runs the stack itself; the causal-LM object keeps only its head code.
        setattr(causal_lm, causal_lm.base_model_prefix, _GivenHiddenStates())
        self.head = causal_lm
        self.attention = nn.ModuleList(
            PagedAttention(config.num_heads, config.num_kv_heads, config.head_dim, window)
            for window in config.sliding_windows
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] of a flattened varlen batch."""
        step = PagedStep(self.attention, kv_caches, metadata)
        out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                           contbatch_step=step)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(inputs_embeds=hidden[None]).logits[0]


def load_transformers_model(
    model_dir: Path,
    config: TransformersModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: Quantization | None = None,
) -> TransformersCausalLM:
    """The model through ``AutoModelForCausalLM`` (safetensors only), on ``contbatch_paged``
    attention, its linear layers packed for the CPU kernels (8-bit where ``quantization`` says so),
    tried on one token."""
    register_paged_attention()
    try:
        causal_lm, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), config=config.hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME,
            use_safetensors=True, output_loading_info=True,
        )  # fmt: skip
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"transformers could not load {config.architecture} from {str(model_dir)!r}: {exc}") from exc
    missing = sorted(info["missing_keys"])
    if missing:  # transformers would fill them with random values
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    if causal_lm.base_model is causal_lm:
        raise ValueError(f"{config.architecture} has no separate transformer stack "
                         f"(no {causal_lm.base_model_prefix!r} module) to run apart from its head")
    causal_lm = causal_lm.to(device).eval()
    _pack_linear_layers(causal_lm, quantization)
    model = TransformersCausalLM(causal_lm, config)
    _try_one_token(model, dtype, device)
    return model


def _pack_linear_layers(model: nn.Module, quantization: Quantization | None) -> None:
    """Swap each ``nn.Linear`` for contbatch's ``Linear`` (same parameters) and lay its weight
    out for the CPU kernels, as the native models do."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                linear = Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(parent, name, linear)
    if quantization is not None:
        quantize_linears(model, quantization, head=model.get_output_embeddings())
    pack_linears(model)
    if quantization is not None and quantization.embeddings:
        table = model.get_input_embeddings().weight
        packed = int8_quantized(table, quantization.block)
        model.set_input_embeddings(Int8Embedding(packed.data, table.dtype))
    move_to_huge_pages(packed_tensors(model))


@torch.inference_mode()
def _try_one_token(model: TransformersCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Run one token through the whole path at load, so a model that asks for what the paged
    kernels lack (sinks, softcapping, another window or K/V shape than its config's) is refused
    before any work rather than at its first step."""
    config = model.config
    shape = (1, config.num_kv_heads, _PROBE_BLOCK_SIZE, config.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(config.num_layers)]
    ints = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64, device=device), block_tables=ints([[0]]),
        seq_lens=ints([1]), query_start_loc=ints([0, 1]), max_query_len=1, max_seq_len=1,
    )  # fmt: skip
    token = torch.zeros(1, dtype=torch.int64, device=device)
    try:
        logits = model.compute_logits(model(token, token, caches, [metadata] * config.num_layers))
    except Exception as exc:  # transformers' code for an arbitrary model: name the model and what failed
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{config.architecture} cannot run on contbatch's paged attention: {reason}") from exc
    if logits.shape[-1] != config.vocab_size:
        raise ValueError(f"{config.architecture}'s head gives {logits.shape[-1]} logits for a vocabulary of "
                         f"{config.vocab_size}")
