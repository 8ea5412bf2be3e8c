"""Prometheus metrics of expert parallelism (a target running with `expert_parallel_size` >
1), registered next to the server's others by `ServerMetrics.attach_expert_parallel`.

Counters (exposed with a `_total` suffix): specmoe:expert_parallel_forward_seconds (rank 0's
forward wall time, the batch's broadcast included), specmoe:expert_parallel_communication_seconds
(of that, broadcasting the batch and the MoE combines' collectives),
specmoe:expert_parallel_collective_bytes (bytes rank 0 sent in those collectives) and
specmoe:expert_parallel_rank_load{rank} (tokens routed to each rank's experts in the steps
the expert load is sampled, under the configured placement: contiguous, or the
--expert-placement file). Gauges: specmoe:expert_parallel_communication_share (communication
over forward time since the previous engine step: the share to watch, which grows with slower
interconnects and more ranks) and specmoe:expert_parallel_expert_rank{expert} (the rank
holding each expert, set at start).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

P = "specmoe:"


class ExpertParallelMetrics:
    """Exports an `ExpertParallelRunner`'s `comm` stats, per-rank load and placement
    (its `expert_map`, the one its ranks hold the experts by).

    Args:
        runner: the engine's target (an `ExpertParallelRunner`).
        model_name: the `model_name` label.
        registry: where to register.
    """

    def __init__(self, runner, model_name: str, registry: CollectorRegistry) -> None:
        self.runner, self.model_name = runner, model_name
        labels = ["model_name"]
        c = lambda name, doc, extra=(): Counter(  # noqa: E731
            P + name, doc, labels + list(extra), registry=registry)
        self.forward_seconds = c("expert_parallel_forward_seconds",
                                 "Rank 0's forward wall time under expert parallelism (s).")
        self.comm_seconds = c("expert_parallel_communication_seconds",
                              "Of the forward time, broadcasting the batch and the MoE "
                              "combines' collectives (s).")
        self.bytes = c("expert_parallel_collective_bytes",
                       "Bytes rank 0 sent in the MoE combines' collectives.")
        self.rank_load = c("expert_parallel_rank_load",
                           "Tokens routed to each rank's experts (sampled steps).", ["rank"])
        self.share = Gauge(P + "expert_parallel_communication_share",
                           "Communication share of forward time since the previous step.",
                           labels, registry=registry)
        for metric in (self.forward_seconds, self.comm_seconds, self.bytes, self.share):
            metric.labels(model_name)
        for rank in range(runner.expert_map.num_ranks):
            self.rank_load.labels(model_name, str(rank))
        self.expert_rank = Gauge(P + "expert_parallel_expert_rank",
                                 "The rank holding each routed expert (the placement).",
                                 labels + ["expert"], registry=registry)
        for expert, rank in enumerate(runner.expert_map.placement):
            self.expert_rank.labels(model_name, str(expert)).set(rank)
        self._last = runner.comm.copy()  # counts start at attach

    def on_step(self, expert_counts: dict[int, list[int]]) -> None:
        """After an engine step: the communication since the previous one, and the
        per-expert counts of the sampled step (layer -> counts; {} when not sampled)."""
        m = self.model_name
        step = self.runner.comm.since(self._last)
        self._last = self.runner.comm.copy()
        if step.forward_seconds > 0:
            self.forward_seconds.labels(m).inc(step.forward_seconds)
            self.comm_seconds.labels(m).inc(max(step.communication_seconds, 0.0))
            self.bytes.labels(m).inc(max(step.collective_bytes, 0))
            self.share.labels(m).set(step.share)
        loads = self.runner.expert_map.rank_loads_over_layers(expert_counts)
        for rank, load in enumerate(loads):
            if load:
                self.rank_load.labels(m, str(rank)).inc(load)
