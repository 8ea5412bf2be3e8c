"""Expert parallelism: a MoE layer's routed experts sharded over the ranks of a
`torch.distributed` process group, and the two ways tokens reach them.

- `ExpertMap` (`layers.moe.placement`): which rank holds each logical expert (contiguous
  blocks, or balanced from measured load: the idea of DeepSeek's EPLB, greedily, with equal
  expert counts per rank).
- `combine_replicated`: every rank holds the whole batch and its routing; it runs only its
  own experts on the (token, slot) pairs routed to them, and one `all_reduce` sums the
  partial outputs (vLLM's naive expert parallelism: one engine, one scheduler).
- `combine_all_to_all`: each rank holds its own tokens; (token, slot) pairs are sorted by
  the rank holding their expert, counts exchanged, rows, expert ids and gate weights sent
  with `all_to_all_single` (uneven splits), computed there, and the weighted outputs sent
  back and summed per token (the Megatron-LM / DeepSpeed-MoE dispatch and combine).
- `combine_token_sliced`: the all-to-all dispatch on a batch every rank holds whole (as in
  the engine, which runs the same forward on every rank): rank r takes its contiguous slice
  of the T tokens, dispatches it with `combine_all_to_all`, and one `all_gather` rebuilds
  the [T, H] output (sequence-parallel MoE: each rank sends only its slice's pairs).

All return, per token, sum_j w_j expert_{id_j}(x): the single-process MoE output, summed
in float32. Each rank's experts run through `run_local(rows [m, H], expert_ids [m]) ->
[m, H]` (unweighted outputs of the rank's own experts, logical ids), e.g. the block's expert
backend on the pairs as tokens with one expert each, so the fused MoE kernel runs them.
`keep_local_experts` drops the experts other ranks hold (at load, before packing), and
`set_expert_parallel` puts a model's MoE blocks in one of the engine's dispatch modes
(`DISPATCH_MODES`). `COLLECTIVES` counts the time and bytes of the collectives the combines
issue, for the communication share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specmoe.layers.moe.placement import ExpertMap


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


class RankFailure(RuntimeError):
    """A collective of the expert-parallel group failed: another rank died, hangs past the
    group's timeout, or left. The group cannot run another forward."""


def group_call(collective, *args, **kwargs):
    """`collective(*args, **kwargs)`, its failure raised as `RankFailure`."""
    try:
        return collective(*args, **kwargs)
    except RuntimeError as e:  # gloo and NCCL report a lost or silent peer as RuntimeError
        raise RankFailure(f"expert parallelism: {collective.__name__} failed: another rank "
                          f"died or did not answer within the group's timeout ({e})") from e


def _timed(collective, nbytes: int, *args, **kwargs) -> None:
    start = time.perf_counter()
    group_call(collective, *args, **kwargs)
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
    return _dispatch_all_to_all(x, topk_ids, topk_weights, run_local, emap, group).to(x.dtype)


def _dispatch_all_to_all(x, topk_ids, topk_weights, run_local, emap, group) -> torch.Tensor:
    """`combine_all_to_all`'s output in float32 ([T, H])."""
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
    return out


def token_slices(num_tokens: int, num_ranks: int) -> list[int]:
    """Bounds of the ranks' contiguous token slices: rank r takes tokens [b[r], b[r + 1])
    of T, floor(r T / R) to floor((r + 1) T / R); a slice may be empty (T < R)."""
    return [r * num_tokens // num_ranks for r in range(num_ranks + 1)]


def combine_token_sliced(x: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, run_local, emap: ExpertMap,
                         group=None) -> torch.Tensor:
    """The MoE output of a batch every rank holds whole, through the all-to-all dispatch
    (module docstring): rank r dispatches only its slice `token_slices(T, R)[r:r + 2]` with
    `combine_all_to_all`; the slices' float32 outputs, padded to the longest slice
    (ceil(T / R) rows), are gathered with one `all_gather` and cut back to T rows.
    Arguments and result as `combine_replicated` (x identical on every rank).

    Returns:
        [T, H] in x's dtype, the same on every rank.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = token_slices(x.shape[0], world)
    if not x.shape[0]:  # every rank sees the same T: all skip the collectives alike
        return torch.zeros_like(x)
    lo, hi = bounds[rank], bounds[rank + 1]
    mine = _dispatch_all_to_all(x[lo:hi], topk_ids[lo:hi], topk_weights[lo:hi], run_local,
                                emap, group)
    padded = mine.new_zeros((max(b - a for a, b in zip(bounds, bounds[1:])), x.shape[1]))
    padded[:hi - lo] = mine
    parts = [torch.empty_like(padded) for _ in range(world)]
    _timed(dist.all_gather, padded.numel() * padded.element_size(), parts, padded,
           group=group)
    return torch.cat([p[:b - a] for p, a, b in zip(parts, bounds, bounds[1:])]).to(x.dtype)


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


DISPATCH_MODES = {"replicated": combine_replicated, "all_to_all": combine_token_sliced}


def set_expert_parallel(model: torch.nn.Module, emap: ExpertMap, group=None,
                        dispatch: str = "replicated") -> None:
    """Every MoE block of `model` computes only this rank's experts, through its expert
    backend, and combines with the other ranks by `dispatch`: "replicated"
    (`combine_replicated`, one all_reduce per layer) or "all_to_all"
    (`combine_token_sliced`: three all_to_all_single and one all_gather per layer, each rank
    sending only its token slice's pairs). Every rank must run the same forwards on the
    same batch. A block may hold all experts or, after `keep_local_experts`, only this
    rank's.

    Raises:
        ValueError: a dispatch not in `DISPATCH_MODES`, or a block whose expert count is
            neither the map's nor this rank's share.
    """
    from specmoe.layers.moe.backends import moe_blocks
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"invalid expert-parallel dispatch={dispatch!r}: must be one of "
                         f"{tuple(DISPATCH_MODES)}")
    combine = DISPATCH_MODES[dispatch]
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
                             combine(x, ids, w, run_local, emap, group))
