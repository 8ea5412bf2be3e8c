"""Expert parallelism: a MoE layer's routed experts sharded over the ranks of a
`torch.distributed` process group, and the two ways tokens reach them.

- `ExpertMap`: which rank holds each logical expert (contiguous blocks, or balanced from
  measured load: the idea of DeepSeek's EPLB, greedily, with equal expert counts per rank).
- `combine_replicated`: every rank holds the whole batch and its routing; it runs only its
  own experts on the (token, slot) pairs routed to them, and one `all_reduce` sums the
  partial outputs (vLLM's naive expert parallelism: one engine, one scheduler).
- `combine_all_to_all`: each rank holds its own tokens; (token, slot) pairs are sorted by
  the rank holding their expert, counts exchanged, rows, expert ids and gate weights sent
  with `all_to_all_single` (uneven splits), computed there, and the weighted outputs sent
  back and summed per token (the Megatron-LM / DeepSpeed-MoE dispatch and combine).

Both return, per token, sum_j w_j expert_{id_j}(x): the single-process MoE output, summed
in float32. Each rank's experts run through `run_local(rows [m, H], expert_ids [m]) ->
[m, H]` (unweighted outputs of the rank's own experts, logical ids), e.g. the block's expert
backend on the pairs as tokens with one expert each, so the fused MoE kernel runs them.
`keep_local_experts` drops the experts other ranks hold (at load, before packing), and
`set_expert_parallel` puts a model's MoE blocks in replicated mode. `COLLECTIVES` counts
the time and bytes of the collectives the combines issue, for the communication share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


@dataclass
class CollectiveStats:
    """Collectives issued by this process's MoE combines: calls, wall seconds spent in them
    (waiting for the slowest rank included) and bytes this rank sent."""

    calls: int = 0
    seconds: float = 0.0
    bytes_sent: int = 0

    def add(self, seconds: float, nbytes: int) -> None:
        self.calls += 1
        self.seconds += seconds
        self.bytes_sent += nbytes


COLLECTIVES = CollectiveStats()


def _timed(collective, nbytes: int, *args, **kwargs) -> None:
    start = time.perf_counter()
    collective(*args, **kwargs)
    COLLECTIVES.add(time.perf_counter() - start, nbytes)


def _weighted(run_local, rows: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """float32 weights[i] * expert_{ids[i]}(rows[i]) for every pair ([m, H])."""
    if not rows.shape[0]:
        return rows.float()
    return run_local(rows, ids).float() * weights[:, None].float()


def combine_replicated(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       run_local, emap: ExpertMap, group=None) -> torch.Tensor:
    """The MoE output with every rank holding the whole batch (module docstring).

    Args:
        x: [T, H] the tokens (identical on every rank).
        topk_ids: [T, k] int64 logical experts; topk_weights: [T, k] gate weights.
        run_local: (rows [m, H], logical expert ids [m] of this rank's experts) -> [m, H].
        emap: the expert placement.
        group: the process group (None: the default).
    Returns:
        [T, H] in x's dtype, the same on every rank.
    """
    rank = dist.get_rank(group)
    placement = torch.tensor(emap.placement, device=topk_ids.device)
    tok, slot = (placement[topk_ids] == rank).nonzero(as_tuple=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, _weighted(run_local, x[tok], topk_ids[tok, slot],
                                     topk_weights[tok, slot]))
    _timed(dist.all_reduce, out.numel() * out.element_size(), out, group=group)
    return out.to(x.dtype)


def combine_all_to_all(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       run_local, emap: ExpertMap, group=None) -> torch.Tensor:
    """The MoE output of this rank's own tokens, dispatched to the ranks holding their
    experts and combined back (module docstring). Arguments as `combine_replicated`, but
    x, topk_ids and topk_weights are this rank's tokens only (any count, 0 included).

    Returns:
        [T, H] in x's dtype, for this rank's tokens.
    """
    world = dist.get_world_size(group)
    placement = torch.tensor(emap.placement, device=topk_ids.device)
    k = topk_ids.shape[1]
    dest = placement[topk_ids].reshape(-1)                              # [T k]
    order = torch.argsort(dest, stable=True)
    tok = order // k
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    _timed(dist.all_to_all_single, send.numel() * send.element_size(), recv, send, group=group)
    send_splits, recv_splits = send.tolist(), recv.tolist()
    # one float32 message per pair: the row, its gate weight, its logical expert id
    payload = torch.cat([x[tok].float(), topk_weights.reshape(-1)[order, None].float(),
                         topk_ids.reshape(-1)[order, None].float()], dim=1)
    got = payload.new_empty((sum(recv_splits), payload.shape[1]))
    _timed(dist.all_to_all_single, payload.numel() * payload.element_size(), got, payload,
           recv_splits, send_splits, group=group)
    y = _weighted(run_local, got[:, :-2].to(x.dtype), got[:, -1].long(), got[:, -2])
    back = y.new_empty((tok.numel(), x.shape[1]))
    _timed(dist.all_to_all_single, y.numel() * y.element_size(), back, y.contiguous(),
           send_splits, recv_splits, group=group)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, back)
    return out.to(x.dtype)


def keep_local_experts(model: torch.nn.Module, emap: ExpertMap, rank: int) -> None:
    """Each MoE block of `model` keeps only the experts `rank` holds under `emap`, so a
    rank's memory holds its share of the routed experts. Call on the loaded dense weights,
    before quantising or packing; `set_expert_parallel` then maps logical ids to them.

    Raises:
        ValueError: a block whose expert count differs from the map's.
    """
    from specmoe.layers.moe.backends import moe_blocks
    local = emap.local_experts(rank)
    for block in moe_blocks(model):
        _check_experts(block, emap.num_experts)
        block.experts = block.experts.subset(local)
        block.run_experts = block.experts.forward


def _check_experts(block, num_experts: int, local: int | None = None) -> None:
    if block.experts.num_experts not in (num_experts, local):
        raise ValueError(f"layer {block.layer_idx} has {block.experts.num_experts} "
                         f"experts; the expert map has {num_experts}")


def set_expert_parallel(model: torch.nn.Module, emap: ExpertMap, group=None) -> None:
    """Every MoE block of `model` computes only this rank's experts, through its expert
    backend, and sums with the other ranks (`combine_replicated`). Every rank must run the
    same forwards on the same batch. A block may hold all experts or, after
    `keep_local_experts`, only this rank's.

    Raises:
        ValueError: a block whose expert count is neither the map's nor this rank's share.
    """
    from specmoe.layers.moe.backends import moe_blocks
    local = emap.local_experts(dist.get_rank(group))
    for block in moe_blocks(model):
        _check_experts(block, emap.num_experts, len(local))
        position = torch.arange(emap.num_experts)  # logical id -> index in block.experts
        if block.experts.num_experts != emap.num_experts:
            position[local] = torch.arange(len(local))
        backend = block.run_experts

        def run_local(rows, ids, backend=backend, position=position):
            ones = torch.ones(ids.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return backend(rows, position.to(ids.device)[ids][:, None], ones)

        block.run_experts = (lambda x, ids, w, run_local=run_local:
                             combine_replicated(x, ids, w, run_local, emap, group))
