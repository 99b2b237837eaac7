"""The paged KV cache: block size, how many blocks fit, the tensor layout, and the tensor.

Layout (docs/design/kv_cache_layout.md): one tensor
``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` in the model's dtype;
each layer reads its ``(key_cache, value_cache)`` pair as views of it. The block manager
hands out block ids into this tensor; the model runner passes the per-layer views to the
model. Everything that sizes or shapes the cache lives here.
"""

import logging
import os
from dataclasses import dataclass

import torch

from contbatch.layers.attention import KVCache
from contbatch.models.config import ModelConfig
from contbatch.models.transformers_config import TransformersModelConfig

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_FRACTION = 0.3
"""Share of available RAM (or free GPU memory) given to the KV cache when its size is not set."""


def resolve_block_size(block_size: int | None, device: torch.device) -> int:
    """The block size to use: the given one, or the default for the device's attention backend
    (flash-attn's paged kernel needs pages of a multiple of 256 tokens)."""
    if block_size is not None:
        return block_size
    from contbatch.layers import flash_attention

    if device.type == "cuda" and flash_attention.available():
        return flash_attention.FLASH_PAGE_MULTIPLE
    return DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of a model's cache, block by block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(
        cls, config: ModelConfig | TransformersModelConfig, block_size: int, dtype: torch.dtype
    ) -> "KVCacheSpec":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * element

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks(
        self, memory: int | None, max_model_len: int, max_num_seqs: int, device: torch.device
    ) -> int:
        """Blocks that ``memory`` bytes hold; by default a share of what the device has free,
        but no more than max_num_seqs full-length sequences can use. ValueError if fewer
        than one max_model_len sequence fits."""
        per_block = self.bytes_per_block
        blocks_per_seq = self.blocks_for(max_model_len)
        if memory is None:
            useful = per_block * blocks_per_seq * max_num_seqs
            memory = min(int(available_memory(device) * DEFAULT_KV_CACHE_FRACTION), useful)
            logger.info("KV cache: %.2f GiB (%d blocks of %d tokens)", memory / 2**30, memory // per_block, self.block_size)
        num_blocks = memory // per_block
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"kv_cache_memory={memory} bytes holds {num_blocks} blocks of {self.block_size} tokens, "
                f"fewer than one max_model_len={max_model_len} sequence needs ({blocks_per_seq}); "
                f"give at least {blocks_per_seq * per_block} bytes or lower max_model_len"
            )
        return num_blocks

    def allocate(self, num_blocks: int, device: torch.device) -> tuple[torch.Tensor, list[KVCache]]:
        """The cache tensor (uninitialised: a block is written before it is read) and its per-layer views."""
        shape = (self.num_layers, 2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        cache = torch.empty(shape, dtype=self.dtype, device=device)
        return cache, [(layer[0], layer[1]) for layer in cache]


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
