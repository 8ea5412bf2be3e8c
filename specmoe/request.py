"""The state of one generation request (L0 contract: no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specmoe.outputs import RequestMetrics, SpecDecodeStats, TokenLogprob
from specmoe.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class DraftState:
    """A request's drafts for its next step: what a proposer proposed and the scheduler,
    the policy and verification read, cut only through `truncate`.

    Attributes:
        token_ids: the draft tokens, in order (empty: none).
        probs: [len(token_ids), vocab_size] float32 torch tensor, the draft distribution q
            each token was sampled from, or None (a deterministic proposer: q one-hot).
        match_length: prompt lookup's matched n-gram length behind the drafts (0: not
            prompt lookup, or nothing matched).
    """

    token_ids: list[int] = field(default_factory=list)
    probs: object = None
    match_length: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncate(self, n: int) -> int:
        """Keep the first `n` drafts (n >= 0; no-op if there are no more); returns how many
        were cut."""
        cut = len(self.token_ids) - n
        if cut <= 0:
            return 0
        self.token_ids = self.token_ids[:n]
        if self.probs is not None:
            self.probs = self.probs[:n]
        return cut

    def clear(self) -> None:
        """Drop every draft."""
        self.token_ids, self.probs, self.match_length = [], None, 0


@dataclass
class Request:
    """A request and everything generated for it so far.

    Attributes:
        output_token_ids: emitted tokens, in order.
        output_logprobs: one entry per emitted token when `params.logprobs` is set.
        text: generated text, set when the request finishes (or when stop strings are
            checked).
        finish_reason: None while running, then "stop", "length", "abort" or "error".
        error: why the engine failed it (finish_reason "error"), else None.
        stop_reason: the stop string or stop token id that ended it (None for EOS/length).
        status: scheduling state.
        num_computed_tokens: leading tokens of `all_token_ids` whose KV is in the cache.
        draft: the drafts to verify in its next step (cleared on preemption and after
            each step).
        num_speculative_tokens: its K (0: no speculation), resolved by the engine.
        num_preemptions: times its KV cache was freed to make room for others.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    draft: DraftState = field(default_factory=DraftState)
    num_speculative_tokens: int = 0
    num_preemptions: int = 0
    _all_token_ids: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output_tokens(self, token_ids: list[int]) -> None:
        """Emit tokens: the only way to add to `output_token_ids` (keeps `all_token_ids`
        in step without copying the prompt each time)."""
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids: one list kept up to date, not a copy (read it,
        never modify it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_left(self) -> int:
        """The most tokens the request may still generate: max_tokens less those
        generated."""
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
