"""Engine statistics: per step and aggregated over an engine's life (L2, no torch)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass, field

from specmoe.outputs import SpecDecodeStats


STEP_ERRORS_KEPT = 4096


@dataclass(slots=True)
class StepStats:
    """Counters of one scheduler step.

    Attributes:
        num_running: requests holding KV cache after scheduling.
        num_waiting: requests queued (new or preempted).
        num_scheduled_requests: the step's batch size.
        num_scheduled_tokens: tokens computed (prompt chunks, last tokens and drafts).
        num_draft_tokens: draft tokens verified.
        num_kv_blocks_used, num_kv_blocks_free: target KV cache blocks after scheduling.
        num_preempted: requests preempted in this step.
        num_logits: rows that produce logits (each scheduled request's last token and
            drafts, once its prompt is complete): the rows through the LM head.
    """

    num_running: int
    num_waiting: int
    num_scheduled_requests: int
    num_scheduled_tokens: int
    num_draft_tokens: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_preempted: int
    num_logits: int


@dataclass
class EngineStats:
    """Totals since the engine started (or since `reset`).

    Attributes:
        num_steps: steps that ran a forward.
        num_scheduled_requests: sum of batch sizes over steps.
        max_batch_size: the largest batch of a step.
        num_scheduled_tokens: tokens computed.
        num_preemptions: requests preempted.
        max_kv_blocks_used: peak target KV cache blocks in use.
        num_generation_tokens: output tokens emitted to requests, counted as each step
            emits them (finished or not).
        spec: the speculation counts of every finished request, merged; its draft_time_s
            and verify_time_s are the engine's own wall-clock seconds spent drafting and in
            steps that verified drafts (each counted once, however many requests shared it).
        num_spec_paused_steps: steps after which drafting was skipped because at least
            `disable_by_batch_size` requests were running or the batch-size table gave K=0
            (counted whether or not any of them would have drafted).
        draft_k_histogram: K -> (request, step) pairs in which a speculating request was
            allowed K drafts (K = 0 included: paused or chosen off).
        step_time_errors: relative errors |predicted - measured| / measured of the adaptive
            policy's predicted forward times (`spec_decode.adaptive`), of the last
            STEP_ERRORS_KEPT predicted steps (a server runs for days; the steps of an idle
            lease, `AdaptivePolicy.grant_lease`, count once, at their mean).
        num_step_time_predictions: predicted steps since start (every error ever appended).
        realized_gain_factors: batch size bucket (its top, a power of two: sizes above
            half of it share it) -> the share of its predicted rate that the
            adaptive policy's speculation realized there, as its last choice at that size
            applied it (`spec_decode.realized`; 1: as predicted or better, or no data).
        num_trimmed_draft_tokens: drafts the adaptive policy cut before verification:
            prompt lookup's by their match length (`spec_decode.match_trim`), any
            proposer's where the step also computes a prompt chunk
            (`AdaptivePolicy.beside_prompts`).
        num_shadow_draft_tokens, num_shadow_accepted_tokens: prompt-lookup drafts proposed
            for requests the adaptive policy held at K = 0 and never verified, and those of
            them the target then emitted in their places (`spec_decode.shadow`).
        last_step: the most recent step's counters.
    """

    num_steps: int = 0
    num_scheduled_requests: int = 0
    max_batch_size: int = 0
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    max_kv_blocks_used: int = 0
    num_generation_tokens: int = 0
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    num_spec_paused_steps: int = 0
    draft_k_histogram: dict[int, int] = field(default_factory=dict)
    step_time_errors: deque[float] = field(
        default_factory=lambda: deque(maxlen=STEP_ERRORS_KEPT))
    num_step_time_predictions: int = 0
    realized_gain_factors: dict[int, float] = field(default_factory=dict)
    num_trimmed_draft_tokens: int = 0
    num_shadow_draft_tokens: int = 0
    num_shadow_accepted_tokens: int = 0
    last_step: StepStats | None = None

    def record_step_time_error(self, error: float) -> None:
        self.step_time_errors.append(error)
        self.num_step_time_predictions += 1

    def record_draft_ks(self, ks, times: int = 1) -> None:
        """Count each K in `ks` (`times` over) in `draft_k_histogram`."""
        for k in ks:
            self.draft_k_histogram[k] = self.draft_k_histogram.get(k, 0) + times

    def record_step(self, step: StepStats) -> None:
        """Add one step's counters."""
        self.num_steps += 1
        self.num_scheduled_requests += step.num_scheduled_requests
        self.max_batch_size = max(self.max_batch_size, step.num_scheduled_requests)
        self.num_scheduled_tokens += step.num_scheduled_tokens
        self.num_preemptions += step.num_preempted
        self.max_kv_blocks_used = max(self.max_kv_blocks_used, step.num_kv_blocks_used)
        self.last_step = step

    @property
    def mean_batch_size(self) -> float:
        return self.num_scheduled_requests / self.num_steps if self.num_steps else 0.0

    def to_dict(self, prefix_cache_hit_rate: float | None = None) -> dict:
        """JSON-ready summary; pass the KV cache manager's hit rate to include it."""
        out = {
            "num_steps": self.num_steps, "mean_batch_size": self.mean_batch_size,
            "max_batch_size": self.max_batch_size,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "num_preemptions": self.num_preemptions,
            "max_kv_blocks_used": self.max_kv_blocks_used,
            "num_generation_tokens": self.num_generation_tokens,
            "spec_decode": self.spec.to_dict(),
            "num_spec_paused_steps": self.num_spec_paused_steps,
            "draft_k_histogram": dict(sorted(self.draft_k_histogram.items())),
            "step_time_prediction_median_error": (statistics.median(self.step_time_errors)
                                                  if self.step_time_errors else None),
            "realized_gain_factors": dict(sorted(self.realized_gain_factors.items())),
            "num_trimmed_draft_tokens": self.num_trimmed_draft_tokens,
            "num_shadow_draft_tokens": self.num_shadow_draft_tokens,
            "num_shadow_accepted_tokens": self.num_shadow_accepted_tokens,
            "last_step": asdict(self.last_step) if self.last_step else None,
        }
        if prefix_cache_hit_rate is not None:
            out["prefix_cache_hit_rate"] = prefix_cache_hit_rate
        return out

