"""One request, start to finish: prefill, then draft-then-verify steps.

Each step runs one target forward over [last, d_1..d_k], where k is bounded by the request's
K, its remaining max_tokens and the context limit; the rejection sampler returns the accepted
drafts plus one recovered or bonus token; the KV cache rolls back to the tokens that stay.
With k = 0 the same code is plain decoding, so sampling is identical with and without
speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specmoe.engine.output_processor import OutputProcessor
from specmoe.outputs import TokenLogprob
from specmoe.request import Request
from specmoe.sample.ops import SamplingTensors, compute_logprobs
from specmoe.sample.rejection_sampler import rejection_sample
from specmoe.spec_decode.proposer import DraftProposal, ProposeRequest
from specmoe.worker.kv_cache import SequenceKVCache
from specmoe.worker.model_runner import ModelRunner


@dataclass(slots=True)
class _Step:
    """Per-request objects shared by every step."""

    req: Request
    cache: SequenceKVCache
    sampling: SamplingTensors
    generator: torch.Generator
    num_speculative_tokens: int


class SequenceGenerator:
    """Runs requests one at a time on a target model with an optional proposer.

    Args:
        target: the target model runner.
        proposer: a Proposer, or None for no speculation.
        processor: finish logic and detokenisation.
        num_speculative_tokens: default K (ignored without a proposer).
    """

    def __init__(self, target: ModelRunner, proposer, processor: OutputProcessor,
                 num_speculative_tokens: int) -> None:
        self.target = target
        self.proposer = proposer
        self.processor = processor
        self.default_k = num_speculative_tokens if proposer is not None else 0

    def run(self, req: Request, generator: torch.Generator) -> None:
        """Generate until `req` finishes; fills its outputs, stats and metrics."""
        k = req.params.num_speculative_tokens
        k = self.default_k if k is None or self.proposer is None else k
        capacity = min(self.target.max_model_len, req.num_tokens + req.params.max_tokens + k + 1)
        step = _Step(req, self.target.new_cache(capacity),
                     SamplingTensors.from_params([req.params], self.target.device), generator, k)
        if self.proposer is not None:
            self.proposer.begin(req.request_id, capacity)
        try:
            t0 = time.perf_counter()
            self._verify(step, DraftProposal([]), req.prompt_token_ids)
            req.metrics.prefill_time_s = req.metrics.first_token_time_s = (
                time.perf_counter() - t0)
            t1 = time.perf_counter()
            while not req.is_finished:
                self._decode_step(step)
            req.metrics.decode_time_s = time.perf_counter() - t1
        finally:
            if self.proposer is not None:
                self.proposer.end(req.request_id)

    def _decode_step(self, step: _Step) -> None:
        req = step.req
        context = req.all_token_ids
        k = min(step.num_speculative_tokens, req.params.max_tokens - len(req.output_token_ids) - 1,
                self.target.max_model_len - len(context) - 1)
        proposal = DraftProposal([])
        if k > 0:
            t0 = time.perf_counter()
            proposal = self.proposer.propose(
                ProposeRequest(req.request_id, context, k, step.sampling, step.generator))
            req.spec_stats.draft_time_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        self._verify(step, proposal, [context[-1]])
        if k > 0:
            req.spec_stats.verify_time_s += time.perf_counter() - t1

    def _verify(self, step: _Step, proposal: DraftProposal, new_tokens: list[int]) -> None:
        """Run the target over `new_tokens` + drafts, sample, append, roll back the cache."""
        req, drafts = step.req, proposal.token_ids
        num_draft = len(drafts)
        logits = self.target.forward(step.cache, new_tokens + drafts,
                                     num_logits=num_draft + 1)  # [num_draft + 1, vocab]
        draft_ids = torch.tensor([drafts], dtype=torch.long, device=logits.device)
        probs = None if proposal.probs is None else proposal.probs.unsqueeze(0)
        out = rejection_sample(logits.unsqueeze(0), draft_ids, probs, step.sampling,
                               [step.generator])
        num_accepted = int(out.num_accepted[0])
        tokens = out.output_token_ids[0, :num_accepted + 1].tolist()
        logprobs = self._logprobs(req, logits[:len(tokens)], tokens)
        num_kept = self.processor.append(req, tokens, logprobs)
        req.spec_stats.record(num_draft, min(num_accepted, num_kept))
        if num_draft:
            req.spec_stats.num_emitted_tokens += num_kept
        step.cache.rollback(req.num_tokens - 1)

    @staticmethod
    def _logprobs(req: Request, logits: torch.Tensor, tokens: list[int]
                  ) -> list[TokenLogprob] | None:
        num_top = req.params.logprobs
        if num_top is None:
            return None
        ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        token_lp, top_ids, top_lp = compute_logprobs(logits, ids, num_top)
        token_lp, top_ids, top_lp = token_lp.tolist(), top_ids.tolist(), top_lp.tolist()
        return [TokenLogprob(t, token_lp[i], list(zip(top_ids[i], top_lp[i])))
                for i, t in enumerate(tokens)]
