"""Token embedding and the language-model head (tied to the embedding or separate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.kernels.gemv import PackedWeight
from specmoe.layers.linear import Linear, PackedWeights, linear


class VocabEmbedding(nn.Module):
    """Token ids [T] int64 -> embeddings [T, H]. Weight: [vocab_size, H]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class TiedProjection(PackedWeights, nn.Module):
    """x @ E^T with the embedding's weight E [vocab_size, H], owning no parameter."""

    def __init__(self, embedding: VocabEmbedding) -> None:
        super().__init__()
        self._embedding = [embedding]  # a list, so the weight is not registered twice
        self.weight_panels = PackedWeight()

    def packed_weights(self) -> list[tuple[PackedWeight, torch.Tensor]]:
        return [(self.weight_panels, self.weight)]

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, vocab_size] in hidden's dtype (through `layers.linear.linear`,
        so decode-sized bf16 inputs on CPU take the native kernel)."""
        return linear(hidden, self.weight, packed=self.weight_panels)


class LMHead(nn.Module):
    """Hidden states [T, H] -> logits [T, vocab_size] float32.

    `proj` is a Linear [vocab_size, H] of its own, or a TiedProjection onto the embedding;
    quantisation may replace it (see `layers.quantization`).
    """

    def __init__(self, vocab_size: int, hidden_size: int,
                 tied: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.proj = TiedProjection(tied) if tied is not None else Linear(hidden_size, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden).float()
