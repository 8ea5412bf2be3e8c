"""Token embedding and the language-model head (tied to the embedding or separate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Token ids [T] int64 -> embeddings [T, H]. Weight: [vocab_size, H]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states [T, H] -> logits [T, vocab_size] float32.

    With `tied` set, reuses the embedding's weight instead of owning one.
    """

    def __init__(self, vocab_size: int, hidden_size: int,
                 tied: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied = tied is not None
        if tied is not None:
            self._embedding = [tied]  # a list, so the weight is not registered twice
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def head_weight(self) -> torch.Tensor:
        return self._embedding[0].weight if self.tied else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight()).float()
