"""The speculation policy: how many tokens each request drafts, step by step.

The engine (`engine.core.EngineCore`) holds one `SpeculationPolicy` and calls it at four
fixed points of a step, and at no other:

1. `before_schedule(view, stats)`: the drafts proposed at the end of the last step may be cut
   now that the next step's batch is known (`DraftState.truncate`).
2. `watch_forward(windows)`: a context around the target's forward (a policy may record the
   experts it routes to).
3. `observe(report, stats)`: after verification, one `StepReport`: the rows, the seconds, the
   drafts verified and accepted per request, the requests going on.
4. `draft_lengths(live, num_running, stats)`: the K of each request going on for the next
   step (`num_speculative_tokens` of the next `ProposeRequest`); then `proposed(report,
   stats)` says how many of each proposal to keep.

`forget(request_id)` drops a request's state when it leaves. Implementations:
`NoSpeculation` (no proposer), `StaticPolicy` (each request's own K, vLLM's
`speculative_disable_by_batch_size`), `BatchSizeTablePolicy` (K by the number of running
requests) and `spec_decode.adaptive.AdaptivePolicy` (K per request and step from measured
acceptance and step times); `build_policy` picks one from a `SpeculativeConfig`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Protocol

from specmoe.config import batch_size_table_k
from specmoe.engine.stats import EngineStats
from specmoe.request import Request


class ScheduleView(Protocol):
    """What a policy reads of the scheduler before a step is scheduled (`engine.scheduler.
    Scheduler` is one)."""

    running: list[Request]
    waiting: object  # a sized, iterable queue of requests

    def prompt_rows_ahead(self, decode_rows: int) -> int:
        """Rows of prompt chunks the next step is expected to compute beside `decode_rows`
        decoding rows."""


@dataclass(slots=True)
class StepReport:
    """What one step ran and verified.

    Attributes:
        windows: the rows each scheduled request computed, in forward order.
        requests: the requests that sampled (reached their last token), in forward order.
        num_draft_tokens: per entry of `requests`, the drafts it verified.
        num_accepted: per request id, its drafts accepted and kept (absent: it failed).
        seconds: wall-clock seconds of the forward and verification.
        any_failed: a request failed alone in the step (`engine.isolation`).
    """

    windows: list[int]
    requests: list[Request]
    num_draft_tokens: list[int]
    num_accepted: dict[str, int]
    seconds: float
    any_failed: bool

    @property
    def live(self) -> list[Request]:
        """The sampled requests going on."""
        return [req for req in self.requests if not req.is_finished]


@dataclass(slots=True)
class DraftReport:
    """One drafting call for the next step.

    Attributes:
        request_ids: the requests asked, in order.
        num_asked: per request, the tokens asked for (its K).
        num_proposed: per request, the tokens proposed (0 where its proposal failed).
        match_lengths: per request, prompt lookup's match length (0: none, or failed).
        failed: per request, whether its proposal raised (the request then fails alone).
        seconds: wall-clock seconds of the call.
        num_live: the requests going on (drafting or not): the next step's decode rows.
    """

    request_ids: list[str]
    num_asked: list[int]
    num_proposed: list[int]
    match_lengths: list[int]
    failed: list[bool]
    seconds: float
    num_live: int


def own_k(req: Request, max_model_len: int) -> int:
    """The most tokens `req` may draft next: its K, within max_tokens and the context."""
    return max(0, min(req.num_speculative_tokens, req.num_tokens_left - 1,
                      max_model_len - req.num_tokens - 1))


class SpeculationPolicy:
    """The interface (module docstring); this base drafts each request's own K and keeps
    every proposal, and its hooks do nothing.

    Args:
        max_model_len: the target's context limit (no request drafts past it).
        num_speculative_tokens: the K of requests that do not set their own.
    """

    def __init__(self, max_model_len: int, num_speculative_tokens: int) -> None:
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens

    @property
    def calibrated(self) -> bool:
        """False while the policy still measures what its choices need (a warm-up runs
        until it is True)."""
        return True

    def request_k(self, num_speculative_tokens: int | None) -> int:
        """A new request's K (`Request.num_speculative_tokens`) from the one it asked for
        (None: the default)."""
        if num_speculative_tokens is None:
            return self.num_speculative_tokens
        return num_speculative_tokens

    def before_schedule(self, view: ScheduleView, stats: EngineStats) -> None:
        """Cut drafts in place before scheduling (counted in
        `stats.num_trimmed_draft_tokens`)."""

    def watch_forward(self, windows: list[int]) -> ContextManager[None]:
        """A context around the target forward whose scheduled requests compute `windows`
        rows each."""
        return contextlib.nullcontext()

    def observe(self, report: StepReport, stats: EngineStats) -> None:
        """The step just verified; called after its finished requests left the scheduler
        and before they are forgotten."""

    def draft_lengths(self, live: list[Request], num_running: int, stats: EngineStats
                      ) -> dict[str, int]:
        """Per request of `live` (those going on), the tokens it drafts for the next step
        (absent or 0: none); `num_running`: requests holding the KV cache, prompts
        included. Records the Ks in `stats.draft_k_histogram`."""
        ks = {req.request_id: own_k(req, self.max_model_len) for req in live}
        stats.record_draft_ks(ks.values())
        return ks

    def proposed(self, report: DraftReport, stats: EngineStats) -> list[int]:
        """How many of each proposal's tokens to verify (at most `report.num_proposed`)."""
        return report.num_proposed

    def forget(self, request_id: str) -> None:
        """The request finished, failed or was aborted."""


class NoSpeculation(SpeculationPolicy):
    """No proposer: no request drafts, nothing is recorded."""

    def __init__(self, max_model_len: int) -> None:
        super().__init__(max_model_len, 0)

    def request_k(self, num_speculative_tokens: int | None) -> int:
        return 0

    def draft_lengths(self, live: list[Request], num_running: int, stats: EngineStats
                      ) -> dict[str, int]:
        return {}


class StaticPolicy(SpeculationPolicy):
    """Each request drafts its own K; none drafts after a step that leaves at least
    `disable_by_batch_size` requests running (None: no limit; `SpeculativeConfig`)."""

    def __init__(self, max_model_len: int, num_speculative_tokens: int,
                 disable_by_batch_size: int | None = None) -> None:
        super().__init__(max_model_len, num_speculative_tokens)
        self.disable_by_batch_size = disable_by_batch_size

    def cap(self, num_running: int) -> int | None:
        """The most tokens any request drafts next (0: speculation pauses; None: no cap)."""
        limit = self.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return 0
        return None

    def draft_lengths(self, live: list[Request], num_running: int, stats: EngineStats
                      ) -> dict[str, int]:
        cap = self.cap(num_running) if num_running else None
        if cap == 0:
            stats.num_spec_paused_steps += 1
        if cap is None:
            return super().draft_lengths(live, num_running, stats)
        ks = {req.request_id: min(own_k(req, self.max_model_len), cap) for req in live}
        stats.record_draft_ks(ks.values())
        return ks


class BatchSizeTablePolicy(StaticPolicy):
    """Requests draft at most the K of the `config.parse_batch_size_table` row holding the
    number of running requests (0 where none holds it), within `disable_by_batch_size`."""

    def __init__(self, max_model_len: int, num_speculative_tokens: int,
                 table: tuple[tuple[int, int, int], ...],
                 disable_by_batch_size: int | None = None) -> None:
        super().__init__(max_model_len, num_speculative_tokens, disable_by_batch_size)
        self.table = table

    def cap(self, num_running: int) -> int | None:
        paused = super().cap(num_running)
        return paused if paused is not None else batch_size_table_k(self.table, num_running)
