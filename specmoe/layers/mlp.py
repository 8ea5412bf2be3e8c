"""The SwiGLU feed-forward block of Llama-style models (Shazeer 2020, arXiv 2002.05202)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
