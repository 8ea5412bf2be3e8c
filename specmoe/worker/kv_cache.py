"""KV cache tensors: the paged cache of a batched engine, and a one-sequence cache on top."""

from __future__ import annotations

import torch

from specmoe.config import ArchConfig
from specmoe.utils.memory import check_fits


class PagedKVCache:
    """Per layer the tensors of `num_blocks` KV cache blocks of `block_size` positions each,
    as flat views ([num_blocks * block_size, ...], slot = block * block_size + offset):
    - attention: a (key, value) pair of [slots, num_kv_heads, head_dim];
    - Multi-Head Latent Attention (`arch.mla`): a 1-tuple (latent,) of [slots,
      kv_lora_rank + qk_rope_head_dim], the normalised c_kv then the RoPE'd shared key
      (`specmoe.layers.mla_attention`), which the heads' keys and values are computed from.

    The block pool (engine/block_pool.py) decides which blocks a sequence owns; this class only
    holds the memory, so scheduling, prefix caching and rollback are the same for both.
    Zero-filled, so padded reads are finite.

    Raises:
        ValueError: `num_blocks` or `block_size` < 1, or a cache larger than the host memory
            available (on the CPU; checked before allocating).
    """

    def __init__(self, arch: ArchConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"invalid num_blocks={num_blocks} / block_size={block_size}: "
                             "both must be >= 1")
        if torch.device(device).type == "cpu":
            check_fits(num_blocks * self.bytes_per_block(arch, block_size, dtype),
                       f"a KV cache of {num_blocks} blocks of {block_size} tokens (lower the "
                       "batch size, max_num_seqs or num_kv_blocks)")
        slots = num_blocks * block_size
        if arch.mla is not None:
            shape = (slots, arch.mla.latent_dim)
            self.layers = [(torch.zeros(shape, dtype=dtype, device=device),)
                           for _ in range(arch.num_hidden_layers)]
        else:
            shape = (slots, arch.num_key_value_heads, arch.head_dim)
            self.layers = [(torch.zeros(shape, dtype=dtype, device=device),
                            torch.zeros(shape, dtype=dtype, device=device))
                           for _ in range(arch.num_hidden_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers (`ArchConfig.kv_cache_values_per_token`
        values per position and layer)."""
        per_token = arch.kv_cache_values_per_token * dtype.itemsize
        return per_token * block_size * arch.num_hidden_layers

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


class SequenceKVCache:
    """The KV cache of one sequence: a private paged cache whose block table is every block.

    `num_computed` counts the leading positions whose keys/values are valid; rolling back
    rejected draft tokens only lowers it (their slots are overwritten by the next forward).

    Raises:
        ValueError: when asked to grow past `capacity` tokens.
    """

    BLOCK_SIZE = 16

    def __init__(self, arch: ArchConfig, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        num_blocks = max(1, -(-capacity // self.BLOCK_SIZE))
        self.paged = PagedKVCache(arch, num_blocks, self.BLOCK_SIZE, dtype, device)
        self.block_ids = list(range(num_blocks))
        self.capacity = capacity
        self.num_computed = 0

    @property
    def layers(self) -> list[tuple[torch.Tensor, ...]]:
        return self.paged.layers

    def check_room(self, num_new: int) -> None:
        if self.num_computed + num_new > self.capacity:
            raise ValueError(f"KV cache overflow: {self.num_computed} + {num_new} tokens > "
                             f"capacity {self.capacity}")

    def rollback(self, num_computed: int) -> None:
        """Keep only the first `num_computed` positions."""
        self.num_computed = min(self.num_computed, num_computed)

    @property
    def num_bytes(self) -> int:
        return self.paged.num_bytes
