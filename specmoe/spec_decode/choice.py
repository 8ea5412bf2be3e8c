"""The adaptive policy's choice of K per request (`spec_decode.adaptive`, module docstring):
the drafts with the most expected tokens first, each draft depth tried, the one with the most
expected tokens per second kept."""

from __future__ import annotations

import numpy as np

from specmoe.spec_decode.time_models import call_rows


def _drafting_seconds(order: np.ndarray, depth: int, lags: np.ndarray, forward_s
                      ) -> np.ndarray:
    """[order.size + 1] seconds of the draft forwards for every prefix of the candidate
    drafts `order` (flat indices into [B, depth]): position 0 adds the request's catch-up
    rows `lags` to the first forward, position j one row to forward j."""
    pos, req = order % depth, order // depth
    rows = np.zeros((order.size + 1, depth))
    rows[np.arange(1, order.size + 1), pos] = np.where(pos == 0, lags[req], 1.0)
    return forward_s(np.cumsum(rows, axis=0)).sum(axis=1)


def choose_ks(gains: np.ndarray, caps: np.ndarray, step_s, draft_s: float,
              miss_step: np.ndarray | None = None, draft_rows=None,
              fills: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """The K per request that maximises expected tokens per second (module docstring).

    Args:
        gains: [B, max_k] expected tokens of each request's j-th draft slot, non-increasing
            in j (with `fills`: the chance the slot is filled times the chance its draft is
            accepted with all before it).
        caps: [B] int, each request's largest K.
        step_s: the target step's seconds from its draft count and (MoE) the log of the
            share of experts its windows miss (two arrays of one shape -> an array of
            seconds), non-decreasing in both.
        draft_s: drafting seconds per depth (with `draft_rows`: the least a forward
            costs, for the bound that may skip the search).
        miss_step: [max_k + 1], a MoE target's log-miss of a window of 1 + j tokens
            (`routing_overlap.miss_log`); None for a dense target.
        draft_rows: None, or (lags [B], forward_s): each request's catch-up rows in the
            first draft forward and the draft's seconds per forward from its rows
            (`DraftTimeModel.forward_s`); the drafting then costs its forwards, not
            draft_s x depth.
        fills: None (every allowed draft is proposed), or [B, max_k] in (0, 1], the chance
            that the proposer fills each request's j-th slot when allowed it, non-increasing
            in j (prompt lookup proposes only what follows a match): a slot then adds that
            many rows (and experts) in expectation, and slots are taken in the order of
            gains / fills, their acceptance.
    Returns:
        (ks [B] int64, the predicted tokens per second).
    """
    b, max_k = gains.shape
    miss = np.zeros(max_k + 1) if miss_step is None else miss_step
    f = np.ones_like(gains) if fills is None else fills
    value = gains / f
    base_miss = b * miss[0]
    best_ks = np.zeros(b, dtype=np.int64)
    best_rate = b / float(step_s(np.zeros(1), np.full(1, base_miss))[0])
    max_depth = min(max_k, int(caps.max(initial=0)))
    if not _may_pay(gains, caps, b / best_rate, draft_s, max_depth, best_rate):
        return best_ks, float(best_rate)
    for depth in range(1, max_depth + 1):
        v = np.where(np.arange(depth)[None, :] < caps[:, None], value[:, :depth], -np.inf)
        order = np.argsort(-v, axis=None, kind="stable")
        order = order[np.isfinite(v.reshape(-1)[order])]
        rows = f[:, :depth].reshape(-1)[order]
        # a request's j-th draft grows its window from j + 1 to j + 2 tokens
        grow = np.diff(miss)[order % depth] * rows
        tokens = b + _prefix_sums(gains[:, :depth].reshape(-1)[order])
        misses = base_miss + _prefix_sums(grow)
        drafting = (draft_s * depth if draft_rows is None
                    else _drafting_seconds(order, depth, *draft_rows))
        seconds = step_s(_prefix_sums(rows), misses) + drafting
        n = int(np.argmax(tokens / seconds))
        rate = tokens[n] / seconds[n]
        if n and rate > best_rate:
            best_rate = rate
            best_ks = np.bincount(order[:n] // depth, minlength=b)
    return best_ks, float(best_rate)


def _prefix_sums(x: np.ndarray) -> np.ndarray:
    """[x.size + 1]: 0, then the running sums of x."""
    out = np.zeros(x.size + 1)
    np.cumsum(x, out=out[1:])
    return out


def _may_pay(gains: np.ndarray, caps: np.ndarray, plain_s: float, draft_s: float,
             max_depth: int, plain_rate: float) -> bool:
    """Whether any draft depth could beat no speculation: at depth D at most every
    allowed draft up to D is accepted, and the step costs at least the plain step plus D
    draft steps (the step time does not fall with more rows or experts). A cheap bound
    that skips `choose_ks`'s search on the steps where speculation is hopeless."""
    if max_depth < 1:
        return False
    allowed = np.where(np.arange(gains.shape[1])[None, :] < caps[:, None], gains, 0.0)
    most = gains.shape[0] + np.cumsum(allowed.sum(axis=0))[:max_depth]
    return bool(np.max(most / (plain_s + draft_s * np.arange(1, max_depth + 1))) > plain_rate)


def predicted_rate(ks: np.ndarray, gains: np.ndarray, step_s, draft_s: float,
                   miss_step: np.ndarray | None = None, draft_rows=None,
                   fills: np.ndarray | None = None) -> float:
    """Expected tokens per second of the batch at `ks` (`choose_ks`'s arguments)."""
    tokens = len(ks) + sum(float(g[:k].sum()) for g, k in zip(gains, ks))
    if draft_rows is None:
        drafting = draft_s * int(ks.max(initial=0))
    else:
        lags, forward_s = draft_rows
        drafting = float(forward_s(call_rows(ks.tolist(), lags.tolist())).sum())
    return tokens / (_step_seconds(ks, gains.shape[1], step_s, miss_step, fills) + drafting)


def _step_seconds(ks: np.ndarray, max_k: int, step_s, miss_step: np.ndarray | None,
                  fills: np.ndarray | None) -> float:
    """The predicted forward seconds at `ks`: each request's first k slots add their
    expected rows (`fills`) and, on a MoE target, grow its window's log-miss in
    proportion."""
    f = (np.arange(max_k)[None, :] < ks[:, None]) * (1.0 if fills is None else fills)
    misses = 0.0
    if miss_step is not None:
        misses = float(len(ks) * miss_step[0] + (f * np.diff(miss_step)).sum())
    return float(step_s(np.array([f.sum()]), np.array([misses]))[0])
