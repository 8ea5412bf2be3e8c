"""One pre-norm decoder block of `DecoderModel`: attention (grouped-query, or DeepSeek's
Multi-head Latent Attention when the config has `mla`), then a dense SwiGLU MLP or a sparse
MoE block. Its own module so that `fused_layers`, which runs a stack of these blocks
in one native call and checks that each layer is exactly this type, and `decoder`, which
builds the stack and owns the fused driver, both depend on it without depending on each
other."""

from __future__ import annotations

import torch
from torch import nn

from specmoe.config import ArchConfig
from specmoe.layers.attention import Attention
from specmoe.layers.mla import MLAttention
from specmoe.layers.mlp import GatedMLP
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.norm import RMSNorm
from specmoe.layers.paged_attention import AttentionMetadata
from specmoe.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: ArchConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = (MLAttention(config, rotary) if config.mla is not None
                     else Attention(config, rotary))
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.moe is not None and layer_idx in config.moe.moe_layers:
            self.mlp = SparseMoEBlock(config.hidden_size, config.moe, layer_idx)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata
                ) -> torch.Tensor:
        """x [T, hidden_size] (not modified); positions [T] int64; this layer's cache
        tensors ((k, v), or (latent,) for MLA: `PagedKVCache`). Returns [T, hidden_size] in
        x's dtype."""
        x = x + self.attn(self.input_norm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attn_norm(x))
