"""The paged KV cache: block size, how many blocks fit, the tensor layout, and the tensor.

Layers are split into KV-cache groups (vLLM's hybrid KV cache): layers with the same
sliding window (or none) share a group, and each sequence has one block table per group.
Most models have one group of every layer. Gemma 3's sliding layers (a window) and global
layers (none) form separate groups, so that the sliding layers' blocks can be freed once
they fall out of the window (contbatch/engine/block_manager.py) while the global layers
keep every token's.

All groups draw from one pool of blocks. A block holds ``block_size`` tokens of
``layers_per_block`` layers: every group has that many layers (the last group of a kind
may leave some places empty), so a block fits any group and the pool needs no split
between them. Layout (docs/design/kv_cache_layout.md): one tensor
``[layers_per_block, 2, num_blocks, num_kv_heads, block_size, row]`` in the model's
dtype (``row`` = head_dim), or int8 with ``kv_cache_dtype="int8"`` (``row`` = head_dim
values and their 4-byte scale); layer ``l`` reads its ``(key_cache, value_cache)`` pair as views of place
``layer_places[l]``, through its group's block table. With one group, places are layers
and the tensor is ``[num_layers, 2, ...]``. Everything that sizes or shapes the cache lives here.
"""

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contbatch.layers.attention import KVCache
from contbatch.models.config import ModelConfig
from contbatch.models.transformers_config import TransformersModelConfig
from contbatch.ops.reference import KV_INT8_SCALE_BYTES

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
class KVCacheGroup:
    """Layers that share one block table per sequence: all have sliding window ``window`` (-1: none)."""

    window: int
    layers: tuple[int, ...]


def kv_cache_groups(layer_windows: Sequence[int]) -> tuple[KVCacheGroup, ...]:
    """Layers grouped by window, every group of the same size (vLLM's rule): the size is the
    fewest layers any window has (or the most, if that is under 1.5 times the fewest, to leave
    fewer places empty), and each kind of layer is dealt round-robin into as many groups as it
    needs. One window for every layer: one group of all layers."""
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    counts = [len(layers) for layers in by_window.values()]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for window, layers in by_window.items():
        num_groups = -(-len(layers) // size)
        groups.extend(KVCacheGroup(window, tuple(layers[i::num_groups])) for i in range(num_groups))
    return tuple(groups)


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of a model's cache, block by block, and its groups of layers."""

    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # of the cache tensor: the model's, or torch.int8 (quantized rows)
    groups: tuple[KVCacheGroup, ...]

    @classmethod
    def for_model(
        cls, config: ModelConfig | TransformersModelConfig, block_size: int, dtype: torch.dtype
    ) -> "KVCacheSpec":
        return cls(config.num_kv_heads, config.head_dim, block_size, dtype, kv_cache_groups(config.sliding_windows))

    @property
    def row_len(self) -> int:
        """Elements of one token's row of one kv head: head_dim, plus the scale's bytes when int8."""
        return self.head_dim + (KV_INT8_SCALE_BYTES if self.dtype == torch.int8 else 0)

    @property
    def num_layers(self) -> int:
        return sum(len(group.layers) for group in self.groups)

    @property
    def layers_per_block(self) -> int:
        return max(len(group.layers) for group in self.groups)

    @property
    def group_windows(self) -> tuple[int, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """Each layer's group."""
        owner = [0] * self.num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                owner[layer] = index
        return tuple(owner)

    @property
    def layer_places(self) -> tuple[int, ...]:
        """Each layer's place in a block (its index in its group)."""
        places = [0] * self.num_layers
        for group in self.groups:
            for place, layer in enumerate(group.layers):
                places[layer] = place
        return tuple(places)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of the pool (``block_size`` tokens of one group's layers)."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.layers_per_block * 2 * self.num_kv_heads * self.block_size * self.row_len * element

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks of the pool that ``num_tokens`` tokens take in every group."""
        return len(self.groups) * -(-num_tokens // self.block_size)

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
        elif memory > (available := available_memory(device)):  # refused before the weights load, not by the allocator
            raise ValueError(
                f"kv_cache_memory={memory} bytes is more than the {available} bytes ({available / 2**30:.1f} GiB) "
                f"this {device.type} has available; give less, or leave it unset for "
                f"{DEFAULT_KV_CACHE_FRACTION:.0%} of what is available"
            )
        num_blocks = memory // per_block
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"kv_cache_memory={memory} bytes holds {num_blocks} blocks of {self.block_size} tokens, "
                f"fewer than one max_model_len={max_model_len} sequence needs ({blocks_per_seq}); "
                f"give at least {blocks_per_seq * per_block} bytes or lower max_model_len"
            )
        return num_blocks

    def allocate(self, num_blocks: int, device: torch.device) -> tuple[torch.Tensor, list[KVCache]]:
        """The cache tensor (uninitialised: a block is written before it is read) and each layer's views.

        On a CPU the cache stays on the allocator's 4 KiB pages, unlike the packed weights
        (contbatch/layers/huge_pages.py): its memory is touched for the first time while requests
        run, and a fresh 2 MiB page can be far slower to back than 4 KiB ones. In this project's
        VMs (Zen 4, 2026-12-02) first writes to 512 MiB ran at 0.22-0.29 GiB/s on huge pages
        against 3.1-3.5 GiB/s on 4 KiB pages, and chat256 gave 12% (bf16) and 14% (int8) more
        output tok/s with the cache on 4 KiB pages (means of two alternated pairs), its median
        TTFT about 3 s shorter; once written, decode attention over huge pages was about 10%
        faster (docs/performance.md, "The KV cache back on 4 KiB pages")."""
        shape = (self.layers_per_block, 2, num_blocks, self.num_kv_heads, self.block_size, self.row_len)
        cache = torch.empty(shape, dtype=self.dtype, device=device)
        return cache, [(cache[place, 0], cache[place, 1]) for place in self.layer_places]


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
