"""Prometheus metrics of the server, in a per-app registry (several apps in one process do not
clash). Names follow vLLM's (`vllm:` -> `specmoe:`) where vLLM has one.

Gauges: specmoe:num_requests_running, specmoe:num_requests_waiting, specmoe:kv_cache_usage_perc,
specmoe:kv_cache_blocks_used, specmoe:kv_cache_blocks_total, specmoe:num_requests_in_flight,
specmoe:spec_decode_realized_gain_factor{batch_size} (the share of its predicted rate that the
adaptive policy's speculation realized at batch sizes up to that power of two and above
half of it, `spec_decode.realized`).
Counters (exposed with a `_total` suffix): specmoe:prefix_cache_queries / _hits (tokens),
specmoe:num_preemptions, specmoe:prompt_tokens, specmoe:generation_tokens,
specmoe:request_success{finished_reason}, specmoe:spec_decode_num_drafts,
specmoe:spec_decode_num_draft_tokens, specmoe:spec_decode_num_accepted_tokens,
specmoe:spec_decode_num_accepted_tokens_per_pos{position},
specmoe:spec_decode_num_paused_steps (steps after which no request drafted: the batch-size
rules or the adaptive policy turned speculation off), specmoe:engine_steps (with the paused
steps: the fraction of steps with speculation off),
specmoe:spec_decode_num_trimmed_draft_tokens (drafts the adaptive policy cut before
verification: by their match length, or beside a prompt chunk), specmoe:spec_decode_num_shadow_draft_tokens and
specmoe:spec_decode_num_shadow_accepted_tokens (prompt-lookup drafts proposed for requests
held at K = 0 and never verified, and those the target then emitted), specmoe:engine_step_failures,
specmoe:http_responses{status} and, for MoE targets, specmoe:moe_expert_load{layer,expert}
(tokens routed to each expert in the sampled steps, one engine step in
`EXPERT_LOAD_EVERY`: recording routing takes a MoE layer off the fused decoder driver, so
only the sampled steps pay for it). Histograms: specmoe:time_to_first_token_seconds,
specmoe:time_per_output_token_seconds, specmoe:e2e_request_latency_seconds (seconds),
specmoe:spec_decode_draft_k (the K each speculating request was allowed per step, 0 =
speculation off), specmoe:spec_decode_step_time_prediction_error (relative error of the
adaptive policy's predicted step time) and specmoe:spec_decode_request_acceptance_rate
(per finished request that drafted). Plus the standard process_* collector (resident
memory, CPU seconds), and under expert parallelism the metrics of `ep_metrics`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)

from specmoe.engine.async_engine import EngineSnapshot, FinishedRecord, NullEngineObserver
from specmoe.entrypoints.openai.ep_metrics import ExpertParallelMetrics
from specmoe.layers.moe.backends import expert_stats, moe_blocks
from specmoe.layers.moe.stats import ExpertLoadRecorder, ExpertStatsHub

P = "specmoe:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)
DRAFT_K_BUCKETS = tuple(float(k) for k in range(17))  # the API caps K at 16; larger: +Inf
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
RATE_BUCKETS = tuple(i / 10 for i in range(1, 11))
EXPERT_LOAD_EVERY = 16


class ServerMetrics(NullEngineObserver):
    """The server's metrics; an engine observer (called in the engine thread).

    Args:
        model_name: the served model name (label `model_name` on every engine metric).
        registry: where to register (default: a new CollectorRegistry).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._last: EngineSnapshot | None = None
        self._last_per_pos: list[int] = []
        self.expert_load: ExpertLoadRecorder | None = None
        self._expert_switch = None
        self.expert_parallel: ExpertParallelMetrics | None = None
        r, labels = self.registry, ["model_name"]
        ProcessCollector(registry=r)
        g = lambda name, doc: Gauge(P + name, doc, labels, registry=r)  # noqa: E731
        c = lambda name, doc, extra=(): Counter(  # noqa: E731
            P + name, doc, labels + list(extra), registry=r)
        self.running = g("num_requests_running", "Requests holding KV cache blocks.")
        self.waiting = g("num_requests_waiting", "Requests queued, not yet running.")
        self.in_flight = g("num_requests_in_flight", "HTTP generation requests being served.")
        self.kv_usage = g("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_used = g("kv_cache_blocks_used", "KV cache blocks in use.")
        self.kv_total = g("kv_cache_blocks_total", "KV cache blocks in the pool.")
        self.realized = Gauge(P + "spec_decode_realized_gain_factor", "Share of its "
                              "predicted rate that the adaptive policy's speculation "
                              "realized, per batch size bucket (batch_size: its top, a "
                              "power of two; 1: as predicted or better).",
                              labels + ["batch_size"], registry=r)
        self.prefix_queries = c("prefix_cache_queries", "Prefix-cache queried tokens.")
        self.prefix_hits = c("prefix_cache_hits", "Prefix-cache hit tokens.")
        self.preemptions = c("num_preemptions", "Requests preempted.")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = c("generation_tokens", "Tokens generated, counted as each "
                                   "engine step emits them.")
        self.success = c("request_success", "Finished requests.", ["finished_reason"])
        self.num_drafts = c("spec_decode_num_drafts", "Verification steps with drafts.")
        self.num_draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted = c("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = c("spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each draft position.", ["position"])
        self.paused_steps = c("spec_decode_num_paused_steps", "Steps after which no request "
                              "drafted: at least disable_by_batch_size requests running, "
                              "or K=0 in the batch-size table.")
        self.trimmed = c("spec_decode_num_trimmed_draft_tokens", "Drafts the adaptive policy "
                         "cut before verification: by their match length, or beside a "
                         "prompt chunk.")
        self.shadow_drafts = c("spec_decode_num_shadow_draft_tokens", "Prompt-lookup drafts "
                               "proposed for requests the adaptive policy held at K = 0, "
                               "never verified.")
        self.shadow_accepted = c("spec_decode_num_shadow_accepted_tokens", "Shadow drafts "
                                 "the target then emitted in their places.")
        self.step_failures = c("engine_step_failures", "Engine steps that raised.")
        self.steps = c("engine_steps", "Engine steps that ran a forward.")
        self.http_responses = Counter(P + "http_responses",
                                      "HTTP responses of /v1 routes by status code.",
                                      ["status"], registry=r)
        h = lambda name, doc, buckets: Histogram(  # noqa: E731
            P + name, doc, labels, buckets=buckets, registry=r)
        self.ttft = h("time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS)
        self.tpot = h("time_per_output_token_seconds", "Time per output token after the "
                      "first (s).", TPOT_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency (s).",
                     E2E_BUCKETS)
        self.draft_k = h("spec_decode_draft_k", "Drafts K each speculating request was "
                         "allowed in a step (0: speculation off).", DRAFT_K_BUCKETS)
        self.step_error = h("spec_decode_step_time_prediction_error", "Relative error of "
                            "the adaptive policy's predicted step time.", ERROR_BUCKETS)
        self.request_acceptance = h("spec_decode_request_acceptance_rate", "Draft tokens "
                                    "accepted / proposed, per finished request that "
                                    "drafted.", RATE_BUCKETS)
        for metric in (self.running, self.waiting, self.in_flight, self.kv_usage, self.kv_used,
                       self.kv_total, self.prefix_queries, self.prefix_hits, self.preemptions,
                       self.prompt_tokens, self.generation_tokens, self.num_drafts,
                       self.num_draft_tokens, self.num_accepted, self.paused_steps,
                       self.trimmed, self.shadow_drafts, self.shadow_accepted,
                       self.step_failures, self.steps, self.ttft, self.tpot, self.e2e,
                       self.draft_k, self.step_error, self.request_acceptance):
            metric.labels(model_name)  # every series is exposed from the start, at 0

    def attach_expert_load(self, model: torch.nn.Module, every: int = EXPERT_LOAD_EVERY
                           ) -> bool:
        """Count expert load of a MoE target (no-op for a dense one) in one engine step of
        every `every` (1: all; see the module docstring); True when attached.

        Raises:
            ValueError: every < 1.
        """
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"invalid every={every!r}: must be an int >= 1")
        blocks = moe_blocks(model)
        if not blocks:
            return False
        self.expert_load = ExpertLoadRecorder(blocks[0].router.num_experts)
        self._expert_switch = _RecorderSwitch(expert_stats(model), self.expert_load, every)
        self._expert_switch.update(0)
        self._expert_counter = Counter(P + "moe_expert_load", "Tokens routed to each expert.",
                                       ["model_name", "layer", "expert"], registry=self.registry)
        return True

    def attach_expert_parallel(self, target) -> bool:
        """Export the communication and per-rank load of an expert-parallel target (one
        with `comm` and `expert_map`: `worker.expert_parallel.ExpertParallelRunner`); a
        no-op returning False for any other."""
        if not hasattr(target, "comm") or not hasattr(target, "expert_map"):
            return False
        self.expert_parallel = ExpertParallelMetrics(target, self.model_name, self.registry)
        return True

    def on_step(self, s: EngineSnapshot) -> None:
        m = self.model_name
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        self.kv_used.labels(m).set(s.num_kv_blocks_used)
        self.kv_total.labels(m).set(s.num_kv_blocks_total)
        self.kv_usage.labels(m).set(s.num_kv_blocks_used / max(1, s.num_kv_blocks_total))
        last = self._last
        self._inc(self.prefix_queries, s.num_prefix_queries, last and last.num_prefix_queries)
        self._inc(self.prefix_hits, s.num_prefix_hits, last and last.num_prefix_hits)
        self._inc(self.preemptions, s.num_preemptions, last and last.num_preemptions)
        self._inc(self.step_failures, s.num_step_failures, last and last.num_step_failures)
        self._inc(self.generation_tokens, s.num_generation_tokens,
                  last and last.num_generation_tokens)
        self._inc(self.steps, s.num_steps, last and last.num_steps)
        self._record_spec(s, last)
        self._record_policy(s, last)
        self._last = replace(s, spec=replace(s.spec, num_accepted_per_position=[]),
                             recent_step_time_errors=())
        counts = self.expert_load.take() if self.expert_load is not None else {}
        for layer, per_expert in counts.items():
            for expert, n in enumerate(per_expert):
                if n:
                    self._expert_counter.labels(m, str(layer), str(expert)).inc(n)
        if self.expert_load is not None:
            self._expert_switch.update(s.num_steps)
        if self.expert_parallel is not None:
            self.expert_parallel.on_step(counts)

    def _record_policy(self, s: EngineSnapshot, last: EngineSnapshot | None) -> None:
        """The K histogram and the step-time prediction errors since the last snapshot;
        the realized gain factors."""
        for batch, factor in s.realized_gain_factors.items():
            self.realized.labels(self.model_name, str(batch)).set(factor)
        before = last.draft_k_histogram if last else {}
        for k, n in s.draft_k_histogram.items():
            for _ in range(n - before.get(k, 0)):
                self.draft_k.labels(self.model_name).observe(k)
        new = s.num_step_time_predictions - (last.num_step_time_predictions if last else 0)
        errors = s.recent_step_time_errors
        for error in errors[len(errors) - min(new, len(errors)):]:
            self.step_error.labels(self.model_name).observe(error)

    def _record_spec(self, s: EngineSnapshot, last: EngineSnapshot | None) -> None:
        spec, prev = s.spec, last.spec if last else None
        self._inc(self.num_drafts, spec.num_drafts, prev and prev.num_drafts)
        self._inc(self.num_draft_tokens, spec.num_draft_tokens, prev and prev.num_draft_tokens)
        self._inc(self.num_accepted, spec.num_accepted_tokens, prev and prev.num_accepted_tokens)
        self._inc(self.paused_steps, s.num_spec_paused_steps, last and last.num_spec_paused_steps)
        self._inc(self.trimmed, s.num_trimmed_draft_tokens,
                  last and last.num_trimmed_draft_tokens)
        self._inc(self.shadow_drafts, s.num_shadow_draft_tokens,
                  last and last.num_shadow_draft_tokens)
        self._inc(self.shadow_accepted, s.num_shadow_accepted_tokens,
                  last and last.num_shadow_accepted_tokens)
        per_pos = spec.num_accepted_per_position
        for pos, n in enumerate(per_pos):
            before = self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0
            if n > before:
                self.accepted_per_pos.labels(self.model_name, str(pos)).inc(n - before)
        self._last_per_pos = list(per_pos)

    def _inc(self, counter: Counter, value: int, previous: int | None) -> None:
        delta = value - (previous or 0)
        if delta > 0:
            counter.labels(self.model_name).inc(delta)

    def on_finished(self, r: FinishedRecord) -> None:
        m = self.model_name
        self.success.labels(m, r.finish_reason).inc()
        self.prompt_tokens.labels(m).inc(r.num_prompt_tokens)
        self.e2e.labels(m).observe(r.e2e_s)
        if r.acceptance_rate is not None:
            self.request_acceptance.labels(m).observe(r.acceptance_rate)
        if r.ttft_s is not None:
            self.ttft.labels(m).observe(r.ttft_s)
            if r.num_output_tokens > 1:
                self.tpot.labels(m).observe((r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _RecorderSwitch:
    """Subscribes an expert-stats recorder to a model's hub for one engine step in `every`
    (the fused decoder driver keeps its table across the switch: it checks that each
    block's recorder is the one it was built with)."""

    def __init__(self, hub: ExpertStatsHub, recorder, every: int) -> None:
        self.hub, self.recorder, self.every = hub, recorder, every

    def update(self, num_steps: int) -> None:
        """Called after `num_steps` steps: record during the next one if it is sampled."""
        if (num_steps + 1) % self.every == 0:
            self.hub.subscribe(self.recorder)
        else:
            self.hub.unsubscribe(self.recorder)
