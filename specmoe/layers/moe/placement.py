"""Expert placement: which rank of an expert-parallel group holds each routed expert, and the
placement file that carries a measured one to `LLM(..., expert_placement=PATH)` (no torch).

One map serves every MoE layer: expert e sits on the same rank in all layers, and a balanced
map is computed from the per-expert load summed over layers (a per-layer map would balance
each layer on its own; the engine does not need it to be correct, only to be balanced).

The placement file is a JSON object; only "placement" is required, so a hand-written
`{"placement": [0, 1, 0, 1]}` is one. `specmoe expert-placement` writes the full form:

    {"format": "specmoe-expert-placement", "version": 1, "num_ranks": R, "num_experts": N,
     "placement": [rank of expert 0, ...], "load": [pairs routed to expert e, summed over
     layers], "predicted": {"contiguous": {"rank_load": [...], "max_over_mean": x},
     "balanced": {...}}, "source": {...how the load was measured}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FORMAT, VERSION = "specmoe-expert-placement", 1
CONTIGUOUS = "contiguous"


@dataclass(frozen=True)
class ExpertMap:
    """placement[e]: the rank that holds logical expert e (the dispatch modes pass logical
    ids to each rank's experts).

    Raises:
        ValueError: a placement naming a rank outside 0..num_ranks - 1, or a rank with none.
    """

    num_ranks: int
    placement: tuple[int, ...]

    def __post_init__(self) -> None:
        bad = [r for r in self.placement if not 0 <= r < self.num_ranks]
        if bad or self.num_ranks < 1:
            raise ValueError(f"invalid placement {self.placement} for {self.num_ranks} ranks")
        empty = sorted(set(range(self.num_ranks)) - set(self.placement))
        if empty:
            raise ValueError(f"ranks {empty} hold no expert: need num_experts >= num_ranks")

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> "ExpertMap":
        """Rank r holds experts [r N / R, (r + 1) N / R)."""
        return cls(num_ranks, tuple(e * num_ranks // num_experts for e in range(num_experts)))

    @classmethod
    def balanced(cls, load: list[float], num_ranks: int) -> "ExpertMap":
        """Heaviest expert first onto the least-loaded rank that still has room for its
        share (ceil(N / R) experts), so ranks carry similar token loads."""
        n = len(load)
        room = -(-n // num_ranks)
        totals, counts, placement = [0.0] * num_ranks, [0] * num_ranks, [0] * n
        for e in sorted(range(n), key=lambda i: (-load[i], i)):
            r = min((r for r in range(num_ranks) if counts[r] < room),
                    key=lambda r: (totals[r], r))
            placement[e] = r
            totals[r] += load[e]
            counts[r] += 1
        return cls(num_ranks, tuple(placement))

    @property
    def num_experts(self) -> int:
        return len(self.placement)

    def local_experts(self, rank: int) -> list[int]:
        """Logical ids of the experts `rank` holds, ascending."""
        return [e for e, r in enumerate(self.placement) if r == rank]

    def rank_loads(self, load: list[float]) -> list[float]:
        """Tokens each rank would serve under this map, from per-expert loads."""
        totals = [0.0] * self.num_ranks
        for e, r in enumerate(self.placement):
            totals[r] += load[e]
        return totals

    def rank_loads_over_layers(self, counts: dict[int, list[int]]) -> list[int]:
        """(token, slot) pairs each rank serves over all MoE layers, from per-layer,
        per-expert counts (layer -> counts)."""
        totals = [0] * self.num_ranks
        for per_expert in counts.values():
            for rank, load in enumerate(self.rank_loads(per_expert)):
                totals[rank] += int(load)
        return totals


def max_over_mean(rank_loads: list[float]) -> float:
    """The busiest rank's load over the mean (1.0: even; the step waits for the busiest);
    1.0 for no load."""
    mean = sum(rank_loads) / len(rank_loads) if rank_loads else 0.0
    return max(rank_loads) / mean if mean > 0 else 1.0


def placement_report(load: list[float], num_ranks: int, source: dict | None = None) -> dict:
    """The placement file's content (module docstring) for per-expert `load` (summed over
    layers): the balanced map, and the predicted per-rank load of contiguous and balanced.

    Raises:
        ValueError: fewer experts than ranks.
    """
    maps = {CONTIGUOUS: ExpertMap.contiguous(len(load), num_ranks),
            "balanced": ExpertMap.balanced(load, num_ranks)}
    predicted = {}
    for name, emap in maps.items():
        ranks = emap.rank_loads(load)
        predicted[name] = {"rank_load": ranks, "max_over_mean": max_over_mean(ranks)}
    return {"format": FORMAT, "version": VERSION, "num_ranks": num_ranks,
            "num_experts": len(load), "placement": list(maps["balanced"].placement),
            "load": list(load), "predicted": predicted, "source": source or {}}


def write_placement(report: dict, path: str | Path) -> Path:
    """Write a `placement_report` as JSON to `path`; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return path


def read_placement(path: str | Path, num_ranks: int,
                   num_experts: int | None = None) -> ExpertMap:
    """The expert map of a placement file, checked against the group and the model.

    Args:
        path: the JSON file (module docstring).
        num_ranks: the expert-parallel size it must be for.
        num_experts: the model's routed experts per MoE layer (None: not checked yet).
    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, no list of int ranks under "placement", a "num_ranks" or
            "num_experts" that differs from the group's or the model's, a rank outside
            0..num_ranks - 1, or a rank that holds no expert (each message names the file
            and the bad value).
    """
    where = f"expert placement {path}"
    if not Path(path).is_file():
        raise FileNotFoundError(f"{where}: no such file")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    ranks = data.get("placement") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or not ranks or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise ValueError(f"{where}: 'placement' must be a non-empty list of int ranks, "
                         f"got {ranks!r}")
    if data.get("num_ranks", num_ranks) != num_ranks:
        raise ValueError(f"{where} is for num_ranks={data['num_ranks']!r}: "
                         f"expert_parallel_size is {num_ranks}")
    _check_counts(where, data, len(ranks), num_experts)
    outside = [(e, r) for e, r in enumerate(ranks) if not 0 <= r < num_ranks]
    if outside:
        e, r = outside[0]
        raise ValueError(f"{where}: expert {e} on rank {r}, outside 0..{num_ranks - 1} "
                         f"(expert_parallel_size={num_ranks})")
    try:
        return ExpertMap(num_ranks, tuple(ranks))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _check_counts(where: str, data: dict, placed: int, num_experts: int | None) -> None:
    if data.get("num_experts", placed) != placed:
        raise ValueError(f"{where}: num_experts={data['num_experts']!r} but 'placement' "
                         f"places {placed} experts")
    if num_experts is not None and placed != num_experts:
        raise ValueError(f"{where} places {placed} experts; the model has {num_experts} "
                         "routed experts per MoE layer")
