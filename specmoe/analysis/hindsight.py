"""The hindsight ceiling of a speculation policy: the fastest per-step schedule of K.

With greedy decoding the target's output does not depend on K, and neither does what a
proposer offers at a given output position (n-gram lookup's continuation for K is the
first K tokens of its continuation for K_max; a draft model's greedy tokens likewise), so
for every output position and K the drafted and accepted counts are fixed
(`model_card.replay`'s `accepted_at`). A policy that knew them all before each step could
pick each step's K to minimise the request's decode time: a shortest path over output
positions, solved by dynamic programming from the end. No causal policy does better under
the same step costs, so its time over the best static K's bounds what choosing K per step
can gain on a workload (the bound a policy's measured gain over static K is read against).

One request (B = 1): exact for the given step costs. Two requests in lockstep
(`pair_seconds`): the joint shortest path over both positions, each step priced by its
total rows; when one request finishes the other goes on alone at B = 1's costs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

AcceptedAt = Callable[[int, int], "tuple[int, int]"]


def _table(accepted_at: AcceptedAt, n: int, max_k: int) -> list[list[tuple[int, int]]]:
    """table[pos][k]: (proposed, accepted) for K = 0..min(max_k, n - pos - 1), K capped at
    the tokens still to come as in `replay`."""
    return [[accepted_at(pos, k) if k else (0, 0) for k in range(min(max_k, n - pos - 1) + 1)]
            for pos in range(n)]


def _backward(table, n: int, step_s, fixed: bool) -> tuple[list[float], list[int]]:
    """best[pos]: the least seconds from output position pos to n (`fixed`: always the
    table's largest K); pick[pos]: the K that reaches it."""
    best, pick = [0.0] * (n + 1), [0] * (n + 1)
    for pos in range(n - 1, 0, -1):
        costs = [step_s(1 + p) + best[min(pos + a + 1, n)] for p, a in table[pos]]
        pick[pos] = len(costs) - 1 if fixed else min(range(len(costs)), key=costs.__getitem__)
        best[pos] = costs[pick[pos]]
    return best, pick


def single_seconds(accepted_at: AcceptedAt, n: int, max_k: int,
                   step_s: Callable[[int], float], static: bool = False
                   ) -> tuple[float, list[int]]:
    """Decode seconds of one request of `n` output tokens (token 0 from the prompt's
    forward, as in `replay`) and its Ks, one per step: the least over every schedule of
    K in 0..max_k, or with `static` K = max_k throughout.

    Args:
        accepted_at: (pos, k) -> (proposed tokens, accepted of them), as for `replay`.
        step_s: rows (1 + proposed) -> seconds of that step.
    Raises:
        ValueError: max_k < 0.
    """
    if max_k < 0:
        raise ValueError(f"invalid max_k={max_k}: must be >= 0")
    table = _table(accepted_at, n, max_k)
    best, pick = _backward(table, n, step_s, static)
    ks, pos = [], min(n, 1)
    while pos < n:
        ks.append(pick[pos])
        pos += table[pos][pick[pos]][1] + 1
    return best[min(n, 1)], ks


def pair_seconds(acc: tuple[AcceptedAt, AcceptedAt], n: tuple[int, int], max_k: int,
                 step2_s: Callable[[int], float], step1_s: Callable[[int], float],
                 static: bool = False) -> float:
    """Decode seconds of two requests run together, each step verifying both (rows = 2 +
    both proposals, priced by `step2_s`); once one is done the other runs alone
    (`step1_s`). The least over every joint schedule of Ks in 0..max_k, or with `static`
    both at K = max_k throughout.

    Raises:
        ValueError: max_k < 0.
    """
    if max_k < 0:
        raise ValueError(f"invalid max_k={max_k}: must be >= 0")
    tables = [_table(a, m, max_k) for a, m in zip(acc, n)]
    alone = [_backward(t, m, step1_s, static)[0] for t, m in zip(tables, n)]

    @lru_cache(maxsize=None)
    def joint(p0: int, p1: int) -> float:
        if p0 >= n[0]:
            return alone[1][min(p1, n[1])]
        if p1 >= n[1]:
            return alone[0][p0]
        o0, o1 = tables[0][p0], tables[1][p1]
        if static:
            o0, o1 = o0[-1:], o1[-1:]
        return min(step2_s(2 + a[0] + b[0]) + joint(p0 + a[1] + 1, p1 + b[1] + 1)
                   for a in o0 for b in o1)

    return joint(min(n[0], 1), min(n[1], 1))
