"""KV cache tensors: the paged cache of a batched engine, and a one-sequence cache on top."""

from __future__ import annotations

import torch

from specmoe.config import KV_CACHE_DTYPES, ArchConfig
from specmoe.layers.int8_kv import Int8KV
from specmoe.layers.paged_attention import FloatKV
from specmoe.utils.memory import check_fits


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype of `SchedulerConfig.kv_cache_dtype` `name`: "auto" is the model's
    dtype, "int8" torch.int8 (`Int8KV`), "bfloat16" / "float32" themselves.

    Raises:
        ValueError: a name not in `KV_CACHE_DTYPES`.
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"invalid kv_cache_dtype={name!r}: must be one of {KV_CACHE_DTYPES}")
    return model_dtype if name == "auto" else getattr(torch, name)


def kv_bytes_per_token(arch: ArchConfig, dtype: torch.dtype) -> int:
    """Bytes of one token's KV cache over all layers in a cache of `dtype` (int8: codes and
    per-head scales).

    Raises:
        ValueError: an int8 cache for a Multi-Head Latent Attention model.
    """
    if dtype is not torch.int8:
        return arch.kv_cache_values_per_token * dtype.itemsize * arch.num_hidden_layers
    if arch.mla is not None:
        raise ValueError("kv_cache_dtype='int8' is not supported for Multi-Head Latent "
                         "Attention models (their latent cache); use 'auto'")
    return Int8KV.bytes_per_token(arch.num_key_value_heads, arch.head_dim) \
        * arch.num_hidden_layers


class PagedKVCache:
    """Per layer the tensors of `num_blocks` KV cache blocks of `block_size` positions each,
    as flat views ([num_blocks * block_size, ...], slot = block * block_size + offset):
    - attention: a `FloatKV` (key, value) pair of [slots, num_kv_heads, head_dim] in
      `dtype`, or for dtype torch.int8 an `Int8KV` (int8 codes and per-token, per-head
      float32 scales);
    - Multi-Head Latent Attention (`arch.mla`): a 1-tuple (latent,) of [slots,
      kv_lora_rank + qk_rope_head_dim], the normalised c_kv then the RoPE'd shared key
      (`specmoe.layers.mla_attention`), which the heads' keys and values are computed from.

    The block pool (engine/block_pool.py) decides which blocks a sequence owns; this class only
    holds the memory, so scheduling, prefix caching and rollback are the same for both.
    Zero-filled, so padded reads are finite.

    Raises:
        ValueError: `num_blocks` or `block_size` < 1, an int8 cache for an MLA model, or a
            cache larger than the host memory available (on the CPU; checked before
            allocating).
    """

    def __init__(self, arch: ArchConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"invalid num_blocks={num_blocks} / block_size={block_size}: "
                             "both must be >= 1")
        per_block = self.bytes_per_block(arch, block_size, dtype)  # raises for MLA int8
        if torch.device(device).type == "cpu":
            check_fits(num_blocks * per_block,
                       f"a KV cache of {num_blocks} blocks of {block_size} tokens (lower the "
                       "batch size, max_num_seqs or num_kv_blocks)")
        slots = num_blocks * block_size
        if arch.mla is not None:
            shape = (slots, arch.mla.latent_dim)
            self.layers = [(torch.zeros(shape, dtype=dtype, device=device),)
                           for _ in range(arch.num_hidden_layers)]
        elif dtype is torch.int8:
            self.layers = [Int8KV.zeros(slots, arch.num_key_value_heads, arch.head_dim, device)
                           for _ in range(arch.num_hidden_layers)]
        else:
            shape = (slots, arch.num_key_value_heads, arch.head_dim)
            self.layers = [FloatKV(torch.zeros(shape, dtype=dtype, device=device),
                                   torch.zeros(shape, dtype=dtype, device=device))
                           for _ in range(arch.num_hidden_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

    @staticmethod
    def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers (`kv_bytes_per_token`). Raises ValueError
        as `kv_bytes_per_token`."""
        return kv_bytes_per_token(arch, dtype) * block_size

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
