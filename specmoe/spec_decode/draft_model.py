"""Drafting with a separate, smaller draft model that shares the target's vocabulary
(Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

The draft model runs batched over every request that drafts in a step, with its own paged KV
cache and block tables (its own `KVCacheManager`, no prefix caching). Before drafting, each
request's draft cache is rolled back to the longest prefix it shares with the current context
(rejected drafts fall away, their blocks are given back); one batched forward runs every
request's missing tokens, then drafting goes on one token per request per forward, requests
leaving the batch when they have drafted their K. A request whose draft blocks cannot be
allocated drafts nothing this step (its draft state is dropped and rebuilt later).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmoe.engine.kv_cache_manager import KVCacheManager
from specmoe.kernels.argmax import argmax
from specmoe.sample.ops import SamplingTensors, compute_probs, sample_from_probs
from specmoe.spec_decode.proposer import DraftProposal, ProposeRequest
from specmoe.worker.model_runner import ModelRunner, SequenceInput


@dataclass(slots=True)
class _Drafting:
    """One request drafting in this step."""

    index: int  # position in the propose() batch
    req: ProposeRequest
    num_tokens: int  # drafts to make
    block_ids: list[int]
    tokens: list[int]
    probs: list[torch.Tensor]


class DraftModelProposer:
    """Proposer backed by a draft `ModelRunner`.

    For greedy requests the draft is greedy and deterministic (probs None); otherwise each
    draft token is sampled from the draft's distribution q under the request's sampling
    parameters and generator, and q is returned for the rejection sampler.

    Args:
        runner: the draft model.
        num_blocks: KV cache blocks of the draft's own cache.
        block_size: token positions per block.
        kv_cache_dtype: the draft cache's `SchedulerConfig.kv_cache_dtype` (the target's, so
            the same blocks take the same share of memory).
    """

    name = "draft"

    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int,
                 kv_cache_dtype: str = "auto") -> None:
        self.runner = runner
        self.cache = runner.new_paged_cache(num_blocks, block_size, kv_cache_dtype)
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self._cached_tokens: dict[str, list[int]] = {}  # tokens whose KV is in the cache

    def free(self, request_id: str) -> None:
        """Drop a request's draft KV cache blocks (no-op if it has none)."""
        if self.kv_cache.has_request(request_id):
            self.kv_cache.free(request_id)
        self._cached_tokens.pop(request_id, None)

    def pending_tokens(self, request_id: str, num_tokens: int) -> int:
        """Tokens of the request's `num_tokens`-token context that its next proposal first
        runs through the draft (its catch-up; at least 1). Counts the cached tokens as a
        prefix of the context, so after a rejection it is short by the rejected drafts (at
        most K - 1): exact for a request that has not drafted for a while, where it
        matters."""
        return max(1, num_tokens - len(self._cached_tokens.get(request_id, ())))

    @torch.inference_mode()
    def propose(self, reqs: list[ProposeRequest]) -> list[DraftProposal]:
        """Draft for every request in one batch (see the module docstring)."""
        proposals = [DraftProposal([]) for _ in reqs]
        drafting, inputs = [], []
        for index, req in enumerate(reqs):
            num_tokens = min(req.max_num_draft_tokens,
                             self.runner.max_model_len - len(req.context))
            seq = self._catch_up(req, num_tokens) if num_tokens > 0 else None
            if seq is not None:
                drafting.append(_Drafting(index, req, num_tokens, seq.block_ids, [], []))
                inputs.append(seq)
        if drafting:
            self._draft(drafting, self.runner.execute(self.cache, inputs))
        for d in drafting:
            greedy = d.req.params.is_greedy
            proposals[d.index] = DraftProposal(d.tokens, None if greedy else torch.cat(d.probs))
            self._cached_tokens[d.req.request_id] = d.req.context + d.tokens[:-1]
        return proposals

    def _catch_up(self, req: ProposeRequest, num_tokens: int) -> SequenceInput | None:
        """Roll the request's draft cache back to its common prefix with the context and make
        room for the missing tokens plus num_tokens - 1 drafts; None if out of blocks."""
        rid, context = req.request_id, req.context
        common = _common_prefix_len(self._cached_tokens.get(rid, []), context)
        common = min(common, len(context) - 1)  # always run >= 1 token to get logits
        if self.kv_cache.has_request(rid):
            self.kv_cache.free_excess(rid, common)
        self._cached_tokens[rid] = context[:common]
        new_blocks = self.kv_cache.allocate_slots(rid, context, len(context) - common,
                                                  num_tokens - 1, num_computed_tokens=common)
        if new_blocks is None:
            self.free(rid)
            return None
        return SequenceInput(context[common:], common, self.kv_cache.get_block_ids(rid), 1)

    def _draft(self, drafting: list[_Drafting], logits: torch.Tensor) -> None:
        """Sample drafts from `logits` ([len(drafting), vocab]) and run the draft model on
        them until every request has its num_tokens."""
        sampling = SamplingTensors.from_params([d.req.params for d in drafting],
                                               self.runner.device)
        while True:
            q = compute_probs(logits, sampling)  # [num_drafting, vocab_size]
            tokens = _sample(q, sampling, [d.req.generator for d in drafting])
            for row, (d, token) in enumerate(zip(drafting, tokens)):
                d.tokens.append(token)
                if not d.req.params.is_greedy:
                    d.probs.append(q[row:row + 1])
            keep = [row for row, d in enumerate(drafting) if len(d.tokens) < d.num_tokens]
            if not keep:
                return
            drafting = [drafting[row] for row in keep]
            sampling = sampling.index_select(torch.tensor(keep, device=q.device))
            logits = self.runner.execute(self.cache, [
                SequenceInput([d.tokens[-1]], len(d.req.context) + len(d.tokens) - 1,
                              d.block_ids, 1) for d in drafting])


def _sample(q: torch.Tensor, sampling: SamplingTensors,
            generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of q: argmax for greedy rows, a draw from q otherwise."""
    if sampling.all_greedy:
        return argmax(q).tolist()
    return sample_from_probs(q, generators).tolist()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
