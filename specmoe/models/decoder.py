"""The decoder-only transformer shared by every supported family: pre-norm blocks of
attention and a dense SwiGLU MLP or a sparse MoE block. Families differ only in how their
config is parsed and how checkpoint names map onto these parameters. The block itself is
`decoder_layer.DecoderLayer` (also importable from here)."""

from __future__ import annotations

import torch
from torch import nn

from specmoe.config import ArchConfig
from specmoe.layers.paged_attention import AttentionMetadata
from specmoe.layers.embed_head import LMHead, VocabEmbedding
from specmoe.layers.norm import RMSNorm
from specmoe.layers.rotary import RotaryEmbedding
from specmoe.models.decoder_layer import DecoderLayer
from specmoe.models.fused_layers import FusedLayers


class DecoderModel(nn.Module):
    """A causal language model.

    Args:
        config: the architecture.
        max_position: longest sequence the RoPE tables cover, in tokens.
    """

    def __init__(self, config: ArchConfig, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # MLA rotates only the qk_rope_head_dim dimensions of its query and shared key
        rope_dim = config.mla.qk_rope_head_dim if config.mla is not None else config.head_dim
        rotary = RotaryEmbedding(rope_dim, max_position, config.rope_theta,
                                 config.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied)
        self.fused_layers = FusedLayers()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]], meta: AttentionMetadata
                ) -> torch.Tensor:
        """input_ids [T] int64; positions [T] int64; one cache per layer ((k, v), or
        (latent,) for MLA: `PagedKVCache`).
        Returns final hidden states [T, hidden_size].

        bf16 models on CPU without MLA run the layers in one native call (`fused_layers`, the
        same kernels and bits as the modules, which run everywhere else)."""
        x = self.embed_tokens(input_ids)  # [T, hidden_size]
        fused = self.fused_layers.try_run(self, x, positions, kv_caches, meta)
        if fused is not None:
            return self.norm(fused)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> logits [T, vocab_size] float32."""
        return self.lm_head(hidden)
