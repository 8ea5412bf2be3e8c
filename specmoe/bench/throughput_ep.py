"""Expert-parallel figures of `bench throughput` runs: the communication over each run and
the (token, slot) pairs each rank's experts served, and their summary per (C, mode)."""

from __future__ import annotations

import dataclasses
import statistics

from specmoe.layers.moe.backends import expert_stats
from specmoe.layers.moe.stats import ExpertLoadRecorder
from specmoe.worker.expert_parallel import CommunicationStats


class CommunicationProbe:
    """Started before a run on an expert-parallel engine (`start`), finished after it.
    Counts every forward's routing: under expert parallelism the MoE layers run as modules
    anyway, so recording costs the fused driver nothing."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.before = llm.target.comm.copy()
        self.recorder = ExpertLoadRecorder(llm.target.expert_map.num_experts)
        expert_stats(llm.target.model).subscribe(self.recorder)

    @classmethod
    def start(cls, llm) -> "CommunicationProbe | None":
        """A probe on `llm`, or None when its target is not expert-parallel."""
        return cls(llm) if hasattr(llm.target, "comm") else None

    def finish(self) -> dict:
        """The run's communication totals' differences (share recomputed) and the pairs
        each rank served over all MoE layers; detaches the recorder."""
        expert_stats(self.llm.target.model).unsubscribe(self.recorder)
        out = self.llm.target.comm.since(self.before).to_dict()
        emap = self.llm.target.expert_map
        return out | {"rank_load": emap.rank_loads_over_layers(self.recorder.take())}


def merge(a: dict | None, b: dict) -> dict:
    """Two `CommunicationProbe.finish` results of one engine (its waves) as one: counts
    summed, the share recomputed, the ranks' loads summed."""
    if a is None:
        return b
    total = CommunicationStats(**{f.name: a[f.name] + b[f.name]
                                  for f in dataclasses.fields(CommunicationStats)})
    return total.to_dict() | {"rank_load": [x + y for x, y in zip(a["rank_load"],
                                                                 b["rank_load"])]}


def summarize(runs: list[dict]) -> dict:
    """Expert-parallel runs of one (C, mode): the median communication share, collective
    bytes per forward and the pairs each rank served, summed over runs ({} otherwise)."""
    ep = [r["expert_parallel"] for r in runs if "expert_parallel" in r]
    if not ep:
        return {}
    loads = [sum(loads) for loads in zip(*(e["rank_load"] for e in ep))]
    return {"communication_share": statistics.median(e["communication_share"] for e in ep),
            "collective_bytes_per_forward": statistics.median(
                e["collective_bytes"] / max(1, e["num_forwards"]) for e in ep),
            "rank_load": loads}
