"""What speculation realized against what the adaptive policy predicted for it, per batch
size: a utility test in the manner of Cascade (arXiv 2506.20675), which measures each
request's tokens per second with and without speculation and turns it off where it loses.

The policy's prediction of a speculating step (its expected tokens over its expected
seconds: the target's forward at the drafts' rows and experts, the drafting, the share of
a catch-up) can be optimistic where the gain is thin: on a 50%-carved Qwen2.5-Coder MoE
with the 0.5B draft at one request it predicted K = 1 5-10% faster than none, and the runs
lost 9% (a resumed request pays its whole catch-up on the first step, then stops drafting
a few steps later; the first drafts' acceptance after a probe reads high). Rather than
model each such cost, the realized rate of the steps the policy chose to speculate on is
compared with the rate it predicted for them, relative to the same comparison on steps
without drafts (so that a bias the step-time model has at every row count cancels):

    factor(B) = (sum tokens / sum seconds) / (sum predicted tokens / sum predicted seconds)
                over speculating steps of B requests
              / (sum predicted seconds / sum seconds) over steps of B requests without drafts

A choice predicted (1 + g) times none's rate then realizes about (1 + g) x factor times
it, so the policy asks (1 + min_gain) / factor of its predictions. The factor is capped at
1 (a guard: it never makes speculation look better than predicted) and shrunk towards 1 by
`prior_steps` pseudo steps, since a step's tokens are one draw of its acceptance. The sums
decay by 1 / `window` a step, so the factor follows the recent steps of each batch size.

A step's tokens are a noisy draw (prompt lookup at two to four requests: the log of a
step's realized / predicted rate has a standard deviation of 0.25-0.45), so a factor read
from a few dozen steps can sit 10% below what the same batch size reads in the next run,
enough to turn a thin but real gain off; and once off, few steps of that size speculate to
correct it. The factor applied is therefore the upper end of a one-sided interval: the
point value times exp(`z` x its standard error), the error from the decayed variance of
the steps' log ratios over their effective count (sum w)^2 / sum w^2 (Kish). Speculation
is asked more of only where the evidence that it realizes less is `z` standard errors
strong, the optimism-under-uncertainty of an upper confidence bound (Auer et al. 2002).

Batch sizes are pooled in powers of two (1, 2, 3-4, 5-8, ...: `batch_bucket`): a batch that
drains passes through each size for a few steps only, so per exact size every factor would
rest on a handful of steps, its interval wide and its upper end 1 at every size. The
realized share moves smoothly with the batch, so sizes within a factor of two share their
evidence."""

from __future__ import annotations

import math


def batch_bucket(batch: int) -> int:
    """The power of two at or above `batch` (>= 1): the batch sizes (bucket / 2, bucket]
    share their realized sums."""
    return 1 << (batch - 1).bit_length()


class RealizedGain:
    """Decayed sums per bucket of batch sizes: [tokens, seconds, predicted tokens,
    predicted seconds, steps, squared step weights, log ratios, squared log ratios] of
    speculating steps and [seconds, predicted seconds, steps] of steps without drafts
    (plain lists: they grow on every step, where numpy's per-call cost on a few floats
    would exceed the arithmetic); `factors`: per bucket (`batch_bucket`), the factor a
    choice last applied (for the stats).

    Raises ValueError for a `window` below 1 or a negative `prior_steps` or `z`."""

    def __init__(self, window: int = 64, prior_steps: float = 8.0, z: float = 1.0) -> None:
        if window < 1 or prior_steps < 0 or z < 0:
            raise ValueError(f"realized check: window {window} must be >= 1, prior_steps "
                             f"{prior_steps} and z {z} >= 0")
        self.decay, self.prior_steps, self.z = 1.0 - 1.0 / window, prior_steps, z
        self._on: dict[int, list[float]] = {}
        self._off: dict[int, list[float]] = {}
        self.factors: dict[int, float] = {}  # batch bucket -> the factor last applied

    def observe_on(self, batch: int, tokens: float, seconds: float,
                   predicted_tokens: float, predicted_seconds: float) -> None:
        """A speculating step of `batch` requests that emitted `tokens` in `seconds` (its
        forward and the drafting call before it), where the choice predicted
        `predicted_tokens` in `predicted_seconds`."""
        x = math.log(max(tokens, 1e-9) * predicted_seconds
                     / max(predicted_tokens * seconds, 1e-12))
        d = self.decay
        self._add(self._on, batch, (d, d, d, d, d, d * d, d, d),
                  (tokens, seconds, predicted_tokens, predicted_seconds, 1.0, 1.0, x, x * x))

    def observe_off(self, batch: int, seconds: float, predicted_seconds: float) -> None:
        """A step of `batch` requests without drafts whose forward took `seconds`, predicted
        `predicted_seconds` by the step-time model."""
        d = self.decay
        self._add(self._off, batch, (d, d, d), (seconds, predicted_seconds, 1.0))

    @staticmethod
    def _add(table: dict[int, list[float]], batch: int, decays: tuple, values: tuple) -> None:
        """Decay the sums of `batch`'s bucket, each by its factor, and add `values`."""
        bucket = batch_bucket(batch)
        sums = table.get(bucket) or [0.0] * len(values)
        table[bucket] = [k * s + v for k, s, v in zip(decays, sums, values)]

    def factor(self, batch: int) -> float:
        """In (0, 1]: the share of its predicted rate that speculation realizes at `batch`
        requests, at the upper end of its interval (module docstring); 1 until speculating
        steps of that size are seen."""
        batch = batch_bucket(batch)
        on = self._on.get(batch)
        if on is None or on[1] <= 0 or on[2] <= 0:
            return 1.0
        tokens, seconds, p_tokens, p_seconds, steps, squares, xs, xxs = on
        raw = (tokens / seconds) / (p_tokens / p_seconds)
        off = self._off.get(batch)
        if off is not None and off[0] > 0 and off[1] > 0:
            raw *= off[0] / off[1]
        weight = steps / (steps + self.prior_steps)
        point = 1.0 + weight * (raw - 1.0)
        variance = max(0.0, xxs / steps - (xs / steps) ** 2)
        error = math.sqrt(variance * squares) / steps  # sqrt(variance / effective steps)
        self.factors[batch] = f = float(min(1.0, point * math.exp(self.z * error)))
        return f
