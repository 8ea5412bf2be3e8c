"""The proposer protocol: anything that drafts the next tokens of a sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specmoe.sample.ops import SamplingTensors


@dataclass(slots=True)
class DraftProposal:
    """Draft tokens for one sequence.

    Attributes:
        token_ids: the proposed continuation, at most the number asked for (may be empty).
        probs: [len(token_ids), vocab_size] float32 draft distribution q each token was
            sampled from, or None for a deterministic proposer (q is then one-hot, as in
            prompt lookup or greedy drafting).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass(slots=True)
class ProposeRequest:
    """What a proposer is asked for one sequence.

    Attributes:
        request_id: identifies per-request proposer state (e.g. a draft KV cache).
        context: prompt + emitted tokens so far.
        num_tokens: at most this many draft tokens (already bounded by max_tokens and the
            context limit).
        sampling: the request's sampling tensors (one row).
        generator: the request's random generator (None: torch's default).
    """

    request_id: str
    context: list[int]
    num_tokens: int
    sampling: SamplingTensors
    generator: torch.Generator | None


class Proposer(Protocol):
    """Drafts tokens; `begin`/`end` bracket one request so per-request state is freed."""

    name: str

    def begin(self, request_id: str, capacity: int) -> None:
        """A request of at most `capacity` tokens starts."""

    def propose(self, req: ProposeRequest) -> DraftProposal:
        """Draft at most `req.num_tokens` tokens continuing `req.context`."""

    def end(self, request_id: str) -> None:
        """The request finished; free its state."""
