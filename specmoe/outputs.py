"""Data that crosses layers (L0 contract: no torch).

Everything here is plain Python (lists, ints, floats) so the scheduler side never sees tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Speculative-decoding statistics of one request or an aggregate.

    Attributes:
        num_drafts: verification steps that carried at least one draft token.
        num_draft_tokens: draft tokens proposed (sum of K over drafts).
        num_accepted_tokens: draft tokens accepted and emitted.
        num_accepted_per_position: accepted count at draft position 0..K-1.
        num_emitted_tokens: tokens emitted by verification steps (accepted + recovered/bonus).
        draft_time_s: seconds spent in the proposer.
        verify_time_s: seconds spent in target forwards and rejection sampling.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_position: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: 1 + accepted / drafts (1 with no drafts)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    def acceptance_per_position(self) -> list[float]:
        """Fraction of drafts whose token at position i was accepted."""
        return [n / self.num_drafts if self.num_drafts else 0.0
                for n in self.num_accepted_per_position]

    def record(self, num_draft: int, num_accepted: int) -> None:
        """Add one verification step with `num_draft` drafts of which the first
        `num_accepted` were accepted."""
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_per_position) < num_draft:
            self.num_accepted_per_position.extend(
                [0] * (num_draft - len(self.num_accepted_per_position)))
        for i in range(num_accepted):
            self.num_accepted_per_position[i] += 1

    def merge(self, other: "SpecDecodeStats", times: bool = True) -> None:
        """Accumulate another stats object into this one; with `times` False, its counts
        only (the requests of a batch share each step's seconds, so their times add up to
        more than the wall time)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        if times:
            self.draft_time_s += other.draft_time_s
            self.verify_time_s += other.verify_time_s
        n = max(len(self.num_accepted_per_position), len(other.num_accepted_per_position))
        mine = self.num_accepted_per_position + [0] * (n - len(self.num_accepted_per_position))
        theirs = other.num_accepted_per_position + [0] * (
            n - len(other.num_accepted_per_position))
        self.num_accepted_per_position = [a + b for a, b in zip(mine, theirs)]

    def to_dict(self) -> dict:
        """JSON-ready summary including the derived rates."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_per_position": self.acceptance_per_position(),
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
        }


@dataclass
class TokenLogprob:
    """Target log-probability of one emitted token and its top alternatives.

    Attributes:
        token_id: the emitted token.
        logprob: natural-log probability under the target model's raw distribution.
        top_logprobs: (token_id, logprob) of the most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Timings of one request, in seconds.

    Attributes:
        prefill_time_s, first_token_time_s: from arrival to its first token (time to first
            token, queueing included).
        decode_time_s: from its first token to its finish.
        arrival_time: `time.perf_counter()` when the engine received it.
    """

    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    first_token_time_s: float = 0.0
    arrival_time: float = 0.0

    def decode_tokens_per_s(self, num_tokens: int) -> float:
        """Tokens after the first per second of decode time."""
        return (num_tokens - 1) / self.decode_time_s if self.decode_time_s > 0 else 0.0


@dataclass
class RequestOutput:
    """The finished result of one generation request.

    Attributes:
        request_id: the engine's id for the request.
        prompt: the prompt text (None when given as token ids).
        prompt_token_ids: the prompt's token ids.
        text: the generated text (special tokens skipped, cut before a stop string).
        token_ids: generated token ids (an EOS or stop token that ended it is included).
        logprobs: per emitted token, when requested.
        finish_reason: "stop" (EOS, stop token or stop string), "length", "abort", or
            "error": a step failed on this request alone and the engine dropped it, keeping
            what it had generated (the others in the step went on).
        stop_reason: the stop string or stop token id that ended it, if any.
        spec_stats: speculative-decoding statistics of this request.
        metrics: timings.
        error: with finish_reason "error", what failed ("<ExceptionType>: <message>").
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str
    stop_reason: str | int | None
    spec_stats: SpecDecodeStats
    metrics: RequestMetrics
    error: str | None = None
