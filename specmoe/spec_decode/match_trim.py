"""Trimming prompt-lookup proposals by their match length (the adaptive policy's
`match_trim`).

Prompt lookup proposes what followed the latest earlier occurrence of the context's last n
tokens, n the longest that matches (`ngram.find_ngram_match`). How far such a copy runs on
depends on n: on SmolLM2-135M over HumanEval and Spec-Bench translation prompts (48 greedy
tokens each, every output position), the first drafted token was accepted after 88% of
3-gram matches, 67% of 2-gram and 24% of 1-gram ones, the eighth after 28%, 23% and 6%.
The per-request estimates the policy solves with average over the matches a request meets;
the match length is known once the proposal is made, so the step's proposals are cut to
the drafts that pay for their rows given their own n: the j-th draft of an n-gram proposal
adds g_n[j] = prod_{i<=j} a_n[i] expected tokens (a_n[i]: the engine-wide rate at which a
reached draft at position i of an n-gram proposal is accepted), and the drafts kept are
those that maximise the step's expected tokens per second under the policy's step-time
model (`cut`). This is the confidence-based draft length of SpecDec++ (Huang et al. 2024,
arXiv 2405.19715) and of transformers' assistant models (`assistant_confidence_threshold`),
with the match length as prompt lookup's confidence and the cut from the step's cost
rather than a constant threshold. On that workload at two and four requests it lifted the
policy from 1.02x to 1.17x and 1.09x plain decoding's tokens per second
(`docs/results/2026-12-06-hindsight-ceiling`).

The rates are learnt from the drafts verified: a cut draft is never verified, so each
match length's proposals go uncut once in `explore_every`, and until a position has
`min_trials` verified drafts its rate is taken as 1 (nothing is cut there).
"""

from __future__ import annotations

from typing import Callable


class MatchLengthTrim:
    """Per match length n (1..max_n) and draft position: reached and accepted drafts.

    Args:
        max_k: the most drafts a proposal has.
        explore_every: every this many-th proposal of a match length is left uncut.
        min_trials: verified drafts a position needs before its rate is used.
    Raises:
        ValueError: max_k < 1, explore_every < 1 or min_trials < 1.
    """

    def __init__(self, max_k: int, explore_every: int = 16, min_trials: int = 16) -> None:
        if max_k < 1 or explore_every < 1 or min_trials < 1:
            raise ValueError(f"invalid MatchLengthTrim(max_k={max_k}, explore_every="
                             f"{explore_every}, min_trials={min_trials}): each must be >= 1")
        self.max_k, self.explore_every, self.min_trials = max_k, explore_every, min_trials
        self._reached: dict[int, list[int]] = {}
        self._accepted: dict[int, list[int]] = {}
        self._proposals: dict[int, int] = {}
        self.trimmed = 0  # drafts cut, all proposals together

    def gains(self, n: int) -> list[float]:
        """[max_k] expected tokens the j-th draft of an n-gram proposal adds: prod_{i<=j}
        of the positions' rates (1 where a position has fewer than min_trials drafts)."""
        reached = self._reached.get(n)
        out, g = [], 1.0
        for j in range(self.max_k):
            if reached is not None and reached[j] >= self.min_trials:
                g *= self._accepted[n][j] / reached[j]
            out.append(g)
        return out

    def cut(self, match_lengths: list[int], proposed: list[int],
            step_s: Callable[[list[int]], float], explore: bool = True) -> list[int]:
        """Per proposal of one step, how many of its drafts to verify: the set of drafts
        that maximises the step's expected tokens per second, (B + the kept drafts'
        gains) / step_s(kept per proposal). For a given number of drafts the best are
        those of most gain (a proposal's gains do not increase along it, so they are a
        prefix of each), so every count is tried in order of gain. Proposals of match
        length 0 (a draft model's) and, with `explore`, each match length's every
        explore_every-th proposal are kept whole; without it (a cut that is not verified,
        `AdaptivePolicy.observe_shadow`) nothing is counted."""
        keep, candidates = [0] * len(proposed), []
        tokens = float(len(proposed))
        gains = {n: self.gains(n) for n in set(match_lengths) if n > 0}  # once per length
        for i, (n, p) in enumerate(zip(match_lengths, proposed)):
            if p <= 0:
                continue
            if n <= 0 or (explore and self._explores(n)):
                keep[i] = p
                if n > 0:
                    tokens += sum(gains[n][:p])
                continue
            candidates += [(g, i) for g in gains[n][:min(p, self.max_k)]]
        candidates.sort(key=lambda c: -c[0])  # stable: a proposal's drafts stay in order
        best_rate, best = tokens / step_s(keep), 0
        for count, (g, i) in enumerate(candidates, 1):
            keep[i] += 1
            tokens += g
            rate = tokens / step_s(keep)
            if rate > best_rate:
                best_rate, best = rate, count
        for g, i in candidates[best:]:
            keep[i] -= 1
        if explore:
            self.trimmed += sum(proposed) - sum(keep)
        return keep

    def _explores(self, n: int) -> bool:
        """Counts a proposal of match length n; True on every explore_every-th."""
        count = self._proposals.get(n, 0) + 1
        self._proposals[n] = count
        return count % self.explore_every == 0

    def observe(self, n: int, drafted: int, accepted: int) -> None:
        """A verified n-gram proposal: `drafted` drafts, the first `accepted` accepted
        (positions 0..accepted reached, the first rejection included)."""
        drafted = min(drafted, self.max_k)
        if n <= 0 or drafted <= 0:
            return
        reached = self._reached.setdefault(n, [0] * self.max_k)
        acc = self._accepted.setdefault(n, [0] * self.max_k)
        for j in range(min(accepted + 1, drafted)):
            reached[j] += 1
        for j in range(min(accepted, drafted)):
            acc[j] += 1
