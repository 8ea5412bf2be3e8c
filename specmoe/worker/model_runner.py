"""Running the model over the not-yet-computed tokens of one sequence."""

from __future__ import annotations

import torch

from specmoe.layers.attention import AttentionMetadata
from specmoe.loader.model_loader import LoadedModel
from specmoe.worker.kv_cache import SequenceKVCache


class ModelRunner:
    """Owns a loaded model; turns token lists into logits through a sequence's KV cache."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.arch = loaded.arch
        self.device = loaded.device
        self.max_model_len = loaded.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def new_cache(self, capacity: int) -> SequenceKVCache:
        """A KV cache for one sequence of at most `capacity` tokens (<= max_model_len)."""
        return SequenceKVCache(self.arch, min(capacity, self.max_model_len),
                               self.loaded.dtype, self.device)

    @torch.inference_mode()
    def forward(self, cache: SequenceKVCache, token_ids: list[int],
                num_logits: int | None = None) -> torch.Tensor:
        """Run `token_ids` at positions [cache.num_computed, +len) and advance the cache.

        Args:
            num_logits: return logits for only the last `num_logits` tokens (None: all).
        Returns:
            logits [num_logits or len(token_ids), vocab_size] float32.
        Raises:
            ValueError: when the tokens do not fit in the cache.
        """
        num_tokens = len(token_ids)
        cache.check_room(num_tokens)
        start = cache.num_computed
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + num_tokens, device=self.device)
        meta = AttentionMetadata.build(start, num_tokens, self.device, self.arch.sliding_window)
        hidden = self.model(ids, positions, cache.layers, meta)  # [T, hidden_size]
        cache.num_computed = start + num_tokens
        if num_logits is not None:
            hidden = hidden[-num_logits:]
        return self.model.compute_logits(hidden)
