"""Drafting with a separate, smaller draft model that shares the target's vocabulary
(Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

The draft model keeps its own KV cache per request. Before drafting it rolls its cache back
to the longest prefix it shares with the current context (rejected drafts fall away), runs
the missing tokens, then drafts autoregressively, one token per forward.
"""

from __future__ import annotations

import torch

from specmoe.sample.ops import compute_probs, sample_from_probs
from specmoe.spec_decode.proposer import DraftProposal, ProposeRequest
from specmoe.worker.kv_cache import SequenceKVCache
from specmoe.worker.model_runner import ModelRunner


class _DraftState:
    def __init__(self, cache: SequenceKVCache) -> None:
        self.cache = cache
        self.tokens: list[int] = []  # tokens whose KV is in the cache, in order


class DraftModelProposer:
    """Proposer backed by a draft `ModelRunner`.

    For greedy requests the draft is greedy and deterministic (probs None); otherwise each
    draft token is sampled from the draft's distribution q under the request's sampling
    parameters, and q is returned for the rejection sampler.
    """

    name = "draft"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.states: dict[str, _DraftState] = {}

    def begin(self, request_id: str, capacity: int) -> None:
        self.states[request_id] = _DraftState(self.runner.new_cache(capacity))

    def end(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def propose(self, req: ProposeRequest) -> DraftProposal:
        num_tokens = min(req.num_tokens, self.runner.max_model_len - len(req.context))
        if num_tokens <= 0:
            return DraftProposal([])
        state = self.states[req.request_id]
        logits = self._catch_up(state, req.context)  # [1, vocab_size]
        greedy = req.sampling.all_greedy
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(num_tokens):
            q = compute_probs(logits, req.sampling)  # [1, vocab_size]
            token = int(q.argmax(-1)) if greedy else int(
                sample_from_probs(q, [req.generator])[0])
            tokens.append(token)
            probs.append(q)
            if i + 1 < num_tokens:
                logits = self.runner.forward(state.cache, [token], num_logits=1)
                state.tokens.append(token)
        return DraftProposal(tokens, None if greedy else torch.cat(probs))

    def _catch_up(self, state: _DraftState, context: list[int]) -> torch.Tensor:
        common = _common_prefix_len(state.tokens, context)
        common = min(common, len(context) - 1)  # always run >= 1 token to get logits
        state.cache.rollback(common)
        state.tokens = context[:common]
        logits = self.runner.forward(state.cache, context[common:], num_logits=1)
        state.tokens = list(context)
        return logits


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
