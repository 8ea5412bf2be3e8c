"""KV cache tensors of one sequence (contiguous; the paged cache comes with batching)."""

from __future__ import annotations

import torch

from specmoe.config import ArchConfig


class SequenceKVCache:
    """Per layer a (key, value) pair of [num_kv_heads, capacity, head_dim] tensors.

    `num_computed` counts the leading positions whose keys/values are valid; rolling back
    rejected draft tokens only lowers it (their slots are overwritten by the next forward).

    Raises:
        ValueError: when asked to grow past `capacity` tokens.
    """

    def __init__(self, arch: ArchConfig, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (arch.num_key_value_heads, capacity, arch.head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(arch.num_hidden_layers)]
        self.capacity = capacity
        self.num_computed = 0

    def check_room(self, num_new: int) -> None:
        if self.num_computed + num_new > self.capacity:
            raise ValueError(f"KV cache overflow: {self.num_computed} + {num_new} tokens > "
                             f"capacity {self.capacity}")

    def rollback(self, num_computed: int) -> None:
        """Keep only the first `num_computed` positions."""
        self.num_computed = min(self.num_computed, num_computed)

    @property
    def num_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)
