"""The adaptive policy's settings, and the constants nothing has needed to set
(docs/adaptive.md says what each mechanism does and which results showed it)."""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_STRENGTH = 4.0  # pseudo-drafts shrinking a request's acceptance towards the engine's
ACCEPTANCE_OPTIMISM = 1.0  # standard errors above the engine-wide rate (an upper bound)
TIME_WINDOW = 256  # steps (and drafting calls) the time models are fitted on
CATCH_UP_HORIZON = 16  # the most steps a resuming request's catch-up is spread over
OVERLAP_PRIOR = 0.4  # adjacent-token routing overlap until one is measured (MoE)
REALIZED_WINDOW = 64  # steps the realized check's sums decay over
REALIZED_PRIOR_STEPS = 8.0  # pseudo-steps at a factor of 1 before evidence counts
REALIZED_Z = 1.0  # standard errors of evidence before more gain is asked


@dataclass(frozen=True)
class AdaptiveSettings:
    """max_k: the largest K any request may draft; min_fit_steps: steps before the time
    models are used (the requests' own K until then); num_experts, top_k: a MoE target's
    routed experts N and top-k (0: dense); the rest: docs/adaptive.md, by name."""

    max_k: int
    hysteresis: float = 0.03
    min_gain: float = 0.05
    probe_every: int = 16
    probe_every_max: int = 256
    recheck_every: int = 32
    recheck_every_max: int = 256
    idle_observe_every: int = 4
    resolve_every: int = 4
    resolve_every_max: int = 16
    min_fit_steps: int = 8
    probe_catch_up_rows: int = 128  # catch-up tokens one probe may run through the draft
    probe_drafts: int = 16  # draft slots one probe may add to the target's step
    probe_budget: float = 0.01  # the share of the time probes may take
    num_experts: int = 0
    top_k: int = 0
    realized_check: bool = True  # ask more gain where speculation realized less
    match_trim: bool = True  # cut prompt-lookup proposals by their match length
    match_trim_explore_every: int = 16  # every this many-th proposal of a length uncut
    shadow_every: int = 0  # tokens between a held request's shadow drafts (0: none)
    recheck_budget: float = 0.01  # the share of an idle batch's time its solves may take

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0
