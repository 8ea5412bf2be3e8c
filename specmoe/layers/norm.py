"""RMSNorm (Zhang and Sennrich 2019, arXiv 1910.07467)."""

from __future__ import annotations

import torch
from torch import nn

from specmoe.kernels.elementwise import try_rms_norm_bf16


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32, cast back to x's dtype
    before the weight multiply (the order HuggingFace Llama uses, so bf16 results agree).

    Args:
        hidden_size: size of the normalised last dimension.
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden_size] -> same shape and dtype. bf16 on CPU takes the native
        kernel (`specmoe.kernels.elementwise`); this code is its reference."""
        y = try_rms_norm_bf16(x, self.weight, self.eps)
        if y is not None:
            return y
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
