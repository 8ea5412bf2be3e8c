"""The adaptive policy's choice of K per request (docs/adaptive.md):
the drafts with the most expected tokens first, each draft depth tried, the one with the most
expected tokens per second kept. All depths are searched in one pass over [depths,
candidates] arrays: a solve per depth in a Python loop cost ~0.4 ms, 3% of a SmolLM2 step
at two requests."""

from __future__ import annotations

import numpy as np


def choose_ks(gains: np.ndarray, caps: np.ndarray, step_s, draft_s: float,
              miss_step: np.ndarray | None = None,
              fills: np.ndarray | None = None, min_gain: float = 0.0,
              starts: np.ndarray | None = None, draft_call_s: float = 0.0
              ) -> tuple[np.ndarray, float]:
    """The K per request that maximises expected tokens per second (module docstring).

    Args:
        gains: [B, max_k] expected tokens of each request's j-th draft slot, non-increasing
            in j (with `fills`: the chance the slot is filled times the chance its draft is
            accepted with all before it).
        caps: [B] int, each request's largest K.
        step_s: the target step's expected seconds from its expected draft rows, (MoE)
            the log of the share of experts its windows miss and the draft rows' variance
            (None: the rows are known) (arrays of one shape, any shape -> an array of
            seconds of that shape), non-decreasing in the first two.
        draft_s: drafting seconds per depth.
        miss_step: [max_k + 1], a MoE target's log-miss of a window of 1 + j tokens
            (`routing_overlap.miss_log`); None for a dense target.
        fills: None (every allowed draft is proposed), or [B, max_k] in (0, 1], the chance
            that the proposer fills each request's j-th slot when allowed it, non-increasing
            in j (prompt lookup proposes only what follows a match): a slot then adds that
            many rows (and experts) in expectation, and slots are taken in the order of
            gains / fills, their acceptance. The rows then vary from step to step (a
            request fills its first m slots, m at least j with chance fills[j - 1]), and
            their variance goes to `step_s`.
        min_gain: the least relative gain over no speculation a choice must predict (0: any
            gain); below it every K is 0.
        starts: None, or [B] seconds each request's drafting adds to the step once it drafts
            at all, whatever its K (its share of its draft catch-up, priced apart from
            `draft_s`), taken with its first draft. A dear start early in the order would
            cut every prefix past it, so the search is run again with the 1, 2, 4, ... and
            all requests of dearest starts left out, and the best kept.
        draft_call_s: seconds a drafting call costs whatever its depth, paid once where
            any request drafts.
    Returns:
        (ks [B] int64, the predicted tokens per second).

    Every depth D is searched at once: the candidates sorted once by value, and depth D's
    prefixes are those of that order with the candidates at positions >= D left out (a
    stable sort keeps their relative order), so the search is a few array operations on
    [depths, candidates] whatever the batch, not a loop of them per depth.
    """
    b, max_k = gains.shape
    miss = np.zeros(max_k + 1) if miss_step is None else miss_step
    base_miss = b * miss[0]
    plain_rate = b / float(step_s(np.zeros(1), np.full(1, base_miss), None)[0])
    best = np.zeros(b, dtype=np.int64), float(plain_rate)
    bar = plain_rate * (1 + min_gain)  # the rate a choice must beat
    if not _may_pay(gains, caps, b / plain_rate + draft_call_s, draft_s,
                    min(max_k, int(caps.max(initial=0))), bar):
        return best
    masks = _dearest_starts(starts, b)
    if len(masks) > 1 and not _relaxed_may_pay(gains, caps, step_s, draft_s, miss, fills,
                                                starts, draft_call_s, bar):
        return best
    for left_out in masks:
        ks, rate = _search(gains, np.where(left_out, 0, caps), step_s, draft_s, miss,
                           fills, starts, draft_call_s)
        if rate > best[1] and rate > bar:
            best = ks, rate
    return best


def _dearest_starts(starts: np.ndarray | None, b: int) -> list[np.ndarray]:
    """[b] bool masks of the requests `choose_ks` leaves out in turn: none, then the 1, 2,
    4, ... and all requests with the dearest positive starts."""
    masks = [np.zeros(b, dtype=bool)]
    if starts is None or not (starts > 0).any():
        return masks
    dear = np.argsort(-starts, kind="stable")[:int((starts > 0).sum())]
    counts = sorted({*(2 ** i for i in range(dear.size.bit_length())), dear.size})
    for m in counts:
        masks.append(masks[0].copy())
        masks[-1][dear[:m]] = True
    return masks


def _search(gains: np.ndarray, caps: np.ndarray, step_s, draft_s: float, miss: np.ndarray,
            fills: np.ndarray | None, starts: np.ndarray | None, draft_call_s: float
            ) -> tuple[np.ndarray, float]:
    """`choose_ks`' search over every draft depth and prefix of the candidates (its
    docstring): the best Ks and their rate (0 where no request may draft)."""
    b, max_k = gains.shape
    f = np.ones_like(gains) if fills is None else fills
    base_miss = b * miss[0]
    max_depth = min(max_k, int(caps.max(initial=0)))
    if max_depth < 1:
        return np.zeros(b, dtype=np.int64), 0.0
    allowed = (np.arange(max_k)[None, :] < caps[:, None]).reshape(-1)
    order = np.argsort(-(gains / f).reshape(-1), kind="stable")
    order = order[allowed[order]]
    pos = order % max_k
    depths = np.arange(1, max_depth + 1)
    taken = pos[None, :] < depths[:, None]  # [D, n]: depth D drafts the candidate
    tokens = b + _prefix_sums(taken * gains.reshape(-1)[order])
    rows = f.reshape(-1)[order]
    # a request's j-th draft grows its window from j + 1 to j + 2 tokens
    misses = base_miss + _prefix_sums(taken * (np.diff(miss)[pos] * rows))
    var = None if fills is None else _prefix_sums(taken * _row_variance(f).reshape(-1)[order])
    drafting = draft_call_s + draft_s * depths[:, None]
    if starts is not None:
        drafting = drafting + _prefix_sums(taken * np.where(pos == 0, starts[order // max_k],
                                                            0.0))
    rate = tokens / (step_s(_prefix_sums(taken * rows), misses, var) + drafting)
    rate[:, 0] = 0.0  # no drafts: the plain rate, which `choose_ks` compares against
    d, n = np.unravel_index(int(np.argmax(rate)), rate.shape)
    if not taken[d, :n].any():
        return np.zeros(b, dtype=np.int64), 0.0
    chosen = order[:n][taken[d, :n]]
    return np.bincount(chosen // max_k, minlength=b), float(rate[d, n])


def _row_variance(fills: np.ndarray) -> np.ndarray:
    """[B, max_k]: what each request's j-th slot adds to the variance of its draft rows m,
    where P(m > j) = fills[j] (non-increasing: a proposal fills a prefix of the slots):
    E[m^2] grows by (2j + 1) fills[j] and E[m]^2 by 2 F_j fills[j] + fills[j]^2, F_j the
    sum of the fills before j. 0 where every slot fills."""
    before = np.cumsum(fills, axis=1) - fills
    j = np.arange(fills.shape[1])[None, :]
    return (2 * j + 1) * fills - 2 * before * fills - fills * fills


def _prefix_sums(x: np.ndarray) -> np.ndarray:
    """[..., n + 1] of x [..., n]: 0, then the running sums along the last axis."""
    out = np.zeros(x.shape[:-1] + (x.shape[-1] + 1,))
    np.cumsum(x, axis=-1, out=out[..., 1:])
    return out


def _may_pay(gains: np.ndarray, caps: np.ndarray, plain_s: float, draft_s: float,
             max_depth: int, plain_rate: float) -> bool:
    """Whether any draft depth could beat `plain_rate` tokens per second (no speculation's,
    plus the gain asked for) in a step of `plain_s` seconds: at depth D at most every
    allowed draft up to D is accepted, and the step costs at least the plain step plus D
    draft steps (the step time does not fall with more rows or experts). A cheap bound
    that skips `choose_ks`'s search on the steps where speculation is hopeless."""
    if max_depth < 1:
        return False
    allowed = np.where(np.arange(gains.shape[1])[None, :] < caps[:, None], gains, 0.0)
    most = gains.shape[0] + np.cumsum(allowed.sum(axis=0))[:max_depth]
    return bool(np.max(most / (plain_s + draft_s * np.arange(1, max_depth + 1))) > plain_rate)


def _relaxed_may_pay(gains: np.ndarray, caps: np.ndarray, step_s, draft_s: float,
                     miss: np.ndarray, fills: np.ndarray | None, starts: np.ndarray,
                     draft_call_s: float, plain_rate: float) -> bool:
    """Whether any choice could beat `plain_rate` with every request's start (its draft
    catch-up) free and its drafts touching no expert the batch's windows did not: one
    search instead of `choose_ks`' one per set of dearest starts left out (log2 B + 2),
    which at 16 requests on tiny-moe took 2 ms, most of a step, on every solve that kept
    the batch off. A bound: the step time is non-decreasing in rows and in the experts'
    share (the fit's weights are non-negative), the starts are non-negative, and the
    drafting costs the same for any choice at one depth (`draft_s` per depth); with every
    slot filled, each prefix of the candidates by value then has the most expected tokens
    of any choice of as many drafts at its depth, so no choice beats the best prefix.
    True (no bound) where slots may go unfilled (`fills` below 1)."""
    if (starts < 0).any() or (fills is not None and not (fills == 1.0).all()):
        return True
    flat = np.full_like(miss, miss[0])  # the drafts add no log-miss: the base windows'
    _, rate = _search(gains, caps, step_s, draft_s, flat, None, None, draft_call_s)
    return rate > plain_rate


def predicted_rate(ks: np.ndarray, gains: np.ndarray, step_s, draft_s: float,
                   miss_step: np.ndarray | None = None,
                   fills: np.ndarray | None = None, starts: np.ndarray | None = None,
                   draft_call_s: float = 0.0) -> float:
    """Expected tokens per second of the batch at `ks` (`choose_ks`'s arguments)."""
    tokens = len(ks) + sum(float(g[:k].sum()) for g, k in zip(gains, ks))
    depth = int(ks.max(initial=0))
    drafting = draft_call_s + draft_s * depth if depth else 0.0
    if starts is not None:
        drafting += float(starts[ks > 0].sum())
    return tokens / (_step_seconds(ks, gains.shape[1], step_s, miss_step, fills) + drafting)


def _step_seconds(ks: np.ndarray, max_k: int, step_s, miss_step: np.ndarray | None,
                  fills: np.ndarray | None) -> float:
    """The predicted forward seconds at `ks`: each request's first k slots add their
    expected rows (`fills`, and their variance) and, on a MoE target, grow its window's
    log-miss in proportion."""
    drafted = np.arange(max_k)[None, :] < ks[:, None]
    f = drafted * (1.0 if fills is None else fills)
    misses = 0.0
    if miss_step is not None:
        misses = float(len(ks) * miss_step[0] + (f * np.diff(miss_step)).sum())
    var = None if fills is None else np.array([(drafted * _row_variance(fills)).sum()])
    return float(step_s(np.array([f.sum()]), np.array([misses]), var)[0])
