"""The SwiGLU feed-forward block of Llama-style models (Shazeer 2020, arXiv 2002.05202)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.kernels.elementwise import try_silu_and_mul_bf16
from specmoe.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one [2I, H] matmul.

    Args:
        hidden_size: H.
        intermediate_size: I.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I] silu(gate) * up; bf16 on CPU takes the native
    kernel (`specmoe.kernels.elementwise`), this torch code is its reference."""
    out = try_silu_and_mul_bf16(gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
