"""Running a model over the new tokens of a batch of sequences through a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmoe.layers.paged_attention import AttentionMetadata, SequenceSlice
from specmoe.loader.model_loader import LoadedModel
from specmoe.worker.kv_cache import PagedKVCache, SequenceKVCache, resolve_kv_cache_dtype


@dataclass(slots=True)
class SequenceInput:
    """One sequence of a batched forward.

    Attributes:
        token_ids: its new tokens, at positions [start_pos, start_pos + len(token_ids)).
        start_pos: tokens already in its KV cache.
        block_ids: its block table in the paged cache.
        num_logits: logits wanted for its last `num_logits` new tokens (0: none, e.g. a prompt
            chunk that does not reach the prompt's end).
    """

    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    num_logits: int


class ModelRunner:
    """Owns a loaded model; turns batches of token lists into logits through a KV cache.

    Attributes:
        failure: what ended the runner's process group (`ExpertParallelRunner`); always None
            in one process.
    """

    failure: Exception | None = None

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.arch = loaded.arch
        self.device = loaded.device
        self.max_model_len = loaded.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def new_paged_cache(self, num_blocks: int, block_size: int,
                        kv_cache_dtype: str = "auto") -> PagedKVCache:
        """A paged KV cache of `num_blocks` blocks of `block_size` positions, of
        `SchedulerConfig.kv_cache_dtype` `kv_cache_dtype`.

        Raises:
            ValueError: as `PagedKVCache` and `resolve_kv_cache_dtype`.
        """
        return PagedKVCache(self.arch, num_blocks, block_size, self.kv_dtype(kv_cache_dtype),
                            self.device)

    def kv_dtype(self, kv_cache_dtype: str) -> torch.dtype:
        """The torch dtype of a `SchedulerConfig.kv_cache_dtype` name for this model."""
        return resolve_kv_cache_dtype(kv_cache_dtype, self.loaded.dtype)

    def new_cache(self, capacity: int) -> SequenceKVCache:
        """A KV cache for one sequence of at most `capacity` tokens (<= max_model_len)."""
        return SequenceKVCache(self.arch, min(capacity, self.max_model_len),
                               self.loaded.dtype, self.device)

    @torch.inference_mode()
    def execute(self, cache: PagedKVCache, seqs: list[SequenceInput]) -> torch.Tensor:
        """One forward over the new tokens of every sequence, writing their keys/values.

        Returns:
            logits [sum of num_logits, vocab_size] float32, sequences in order.
        Raises:
            ValueError: no sequences, an empty sequence, num_logits larger than its tokens, or
                a block table too short for its positions.
        """
        for i, s in enumerate(seqs):
            if not 0 <= s.num_logits <= len(s.token_ids):
                raise ValueError(f"sequence {i}: invalid num_logits={s.num_logits} for "
                                 f"{len(s.token_ids)} tokens")
        slices = [SequenceSlice(s.start_pos, len(s.token_ids), s.block_ids) for s in seqs]
        meta = AttentionMetadata.build(slices, cache.block_size, self.device,
                                       self.arch.sliding_window)
        ids, positions, logit_rows = [], [], []
        for s in seqs:
            end = len(ids) + len(s.token_ids)
            ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            logit_rows.extend(range(end - s.num_logits, end))
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device),
                            torch.tensor(positions, dtype=torch.long, device=self.device),
                            cache.layers, meta)  # [num_tokens, hidden_size]
        if len(logit_rows) != len(ids):
            hidden = hidden[torch.tensor(logit_rows, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(hidden)

    def forward(self, cache: SequenceKVCache, token_ids: list[int],
                num_logits: int | None = None) -> torch.Tensor:
        """Run one sequence's `token_ids` at positions [cache.num_computed, +len).

        Args:
            num_logits: return logits for only the last `num_logits` tokens (None: all).
        Returns:
            logits [num_logits or len(token_ids), vocab_size] float32.
        Raises:
            ValueError: when the tokens do not fit in the cache.
        """
        cache.check_room(len(token_ids))
        num_logits = len(token_ids) if num_logits is None else num_logits
        seq = SequenceInput(list(token_ids), cache.num_computed, cache.block_ids, num_logits)
        logits = self.execute(cache.paged, [seq])
        cache.num_computed += len(token_ids)
        return logits
