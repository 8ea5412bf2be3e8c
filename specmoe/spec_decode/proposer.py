"""The proposer protocol: anything that drafts the next tokens of a sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specmoe.sampling_params import SamplingParams


@dataclass(slots=True)
class DraftProposal:
    """Draft tokens for one sequence.

    Attributes:
        token_ids: the proposed continuation, at most the number asked for (may be empty).
        probs: [len(token_ids), vocab_size] float32 draft distribution q each token was
            sampled from, or None for a deterministic proposer (q is then one-hot, as in
            prompt lookup or greedy drafting).
        match_length: prompt lookup's matched n-gram length n (0: not prompt lookup, or
            nothing matched), the evidence behind the proposal: on SmolLM2-135M over code
            and translation prompts a 3-gram match's first token was accepted 88% of the
            time, a 1-gram match's 24%.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    match_length: int = 0


@dataclass(slots=True)
class ProposeRequest:
    """What a proposer is asked for one sequence.

    Attributes:
        request_id: identifies per-request proposer state (e.g. a draft KV cache).
        context: prompt + emitted tokens so far.
        max_num_draft_tokens: at most this many draft tokens (the request's K for this
            step, already bounded by max_tokens and the context limit).
        params: the request's sampling parameters (a draft model drafts under them).
        generator: the request's random generator (None: torch's default).
    """

    request_id: str
    context: list[int]
    max_num_draft_tokens: int
    params: SamplingParams
    generator: torch.Generator | None


class Proposer(Protocol):
    """Drafts tokens for a batch of requests; per-request state (e.g. a draft model's KV
    cache) is created on a request's first proposal and dropped by `free`."""

    name: str

    def propose(self, reqs: list[ProposeRequest]) -> list[DraftProposal]:
        """Draft at most `r.max_num_draft_tokens` tokens continuing `r.context` for each request, in
        order (an empty proposal when it cannot draft)."""

    def free(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: drop its state (no-op if none)."""


class NoProposer:
    """The proposer of an engine without speculation (`policy.NoSpeculation` never asks
    it): proposes nothing, keeps no state."""

    name = "none"

    def propose(self, reqs: list[ProposeRequest]) -> list[DraftProposal]:
        return [DraftProposal([]) for _ in reqs]

    def free(self, request_id: str) -> None:
        """Nothing to drop."""
