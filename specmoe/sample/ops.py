"""Sampling primitives shared by plain sampling and the rejection sampler (L5).

Everything here is vectorised over rows (one row = one request, or one request position during
verification) and free of host synchronisation: no `.item()`, `.tolist()` or data-dependent
shapes. Randomness comes only from per-row `torch.Generator`s (None = torch's default generator
of the device), drawn in a documented order so that a seeded request reproduces its output.

Sources:
    - Top-p (nucleus) sampling: Holtzman et al., 2020, "The Curious Case of Neural Text
      Degeneration", arXiv 1904.09751, Sec. 3.1.
    - Min-p sampling: Nguyen et al., 2024, "Turning Up the Heat: Min-p Sampling for Creative
      and Coherent LLM Outputs", arXiv 2407.01082.
    - Exponential race (Gumbel-max in ratio form): if E_v ~ Exp(1) i.i.d., then
      argmax_v p_v / E_v = argmin_v E_v / p_v is distributed as Categorical(p), since
      E_v / p_v ~ Exp(rate p_v) and the minimum of independent exponentials is attained at v
      with probability p_v / sum(p) (see e.g. Maddison et al., 2014, "A* Sampling", Sec. 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specmoe.kernels.argmax import argmax
from specmoe.sampling_params import SamplingParams

# Smallest positive float32: exponentials are clamped to it so that p / E is never 0 / 0
# (NaN wins torch.argmax) and stays finite for p <= 1.
_TINY = torch.finfo(torch.float32).tiny

MAX_TOP_K = 2**31 - 1  # larger than any vocabulary


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors, one row per request (or per request position).

    Attributes:
        temperature: [num_rows] float32; 0 means greedy (argmax of the raw logits).
        top_k: [num_rows] int64; 0 disables.
        top_p: [num_rows] float32 in (0, 1]; 1 disables.
        min_p: [num_rows] float32 in [0, 1]; 0 disables.
        all_greedy: True only if every row is greedy (no randomness is drawn then).
        any_top_k, any_top_p, any_min_p: False guarantees that no sampled row uses the filter,
            so it is skipped. They are conservative: True with no row using the filter only
            costs time (a disabled value is a no-op), never correctness.
    """

    temperature: Tensor  # [num_rows] float32
    top_k: Tensor  # [num_rows] int64
    top_p: Tensor  # [num_rows] float32
    min_p: Tensor  # [num_rows] float32
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams],
                    device: torch.device | str = "cpu") -> SamplingTensors:
        """Build the tensors from one `SamplingParams` per row, on `device`.

        Greedy rows do not switch the filter flags on (their filters are never applied).
        """
        sampled = [p for p in params if not p.is_greedy]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                     device=device),
            # A top_k past any vocabulary keeps every token, as off does; bounding it keeps
            # an int64 from overflowing (a request's top_k can be any integer).
            top_k=torch.tensor([min(max(p.top_k, 0), MAX_TOP_K) for p in params],
                               dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            all_greedy=not sampled,
            any_top_k=any(p.top_k > 0 for p in sampled),
            any_top_p=any(p.top_p < 1.0 for p in sampled),
            any_min_p=any(p.min_p > 0.0 for p in sampled),
        )

    @property
    def num_rows(self) -> int:
        """Number of rows."""
        return self.temperature.shape[0]

    @property
    def is_greedy(self) -> Tensor:
        """[num_rows] bool: rows with temperature 0."""
        return self.temperature == 0

    def index_select(self, index: Tensor) -> SamplingTensors:
        """Rows `index` ([num_selected] int64, on the tensors' device), in that order.

        The flags are copied (still conservative for any subset).
        """
        return SamplingTensors(
            self.temperature.index_select(0, index), self.top_k.index_select(0, index),
            self.top_p.index_select(0, index), self.min_p.index_select(0, index),
            self.all_greedy, self.any_top_k, self.any_top_p, self.any_min_p)

    def repeat_rows(self, counts: list[int] | int) -> SamplingTensors:
        """Repeat row i `counts[i]` times (or every row `counts` times), keeping order.

        Used to expand per-request parameters to per-position rows for verification
        (count K+1 per request). No host synchronisation.

        Raises:
            ValueError: if `counts` has the wrong length or a negative count.
        """
        if isinstance(counts, int):
            if counts < 0:
                raise ValueError(f"invalid counts={counts}: must be >= 0")
            return self._map(lambda t: t.repeat_interleave(counts, dim=0))
        if len(counts) != self.num_rows or any(c < 0 for c in counts):
            raise ValueError(f"invalid counts={counts!r}: must be {self.num_rows} "
                             "non-negative integers (one per row)")
        repeats = torch.tensor(counts, dtype=torch.int64, device=self.temperature.device)
        total = sum(counts)
        return self._map(lambda t: t.repeat_interleave(repeats, dim=0, output_size=total))

    def _map(self, fn) -> SamplingTensors:
        return SamplingTensors(fn(self.temperature), fn(self.top_k), fn(self.top_p),
                               fn(self.min_p), self.all_greedy, self.any_top_k,
                               self.any_top_p, self.any_min_p)


def compute_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """The distribution each row samples from (target p or draft q), in float32.

    Stages, per row: logits / temperature; top-k (keep the k largest; ties at the k-th value go
    to the lower token id); top-p (keep the smallest prefix of tokens sorted by probability whose
    cumulative probability is >= top_p, always at least the top token; Holtzman et al., 2020,
    Sec. 3.1); min-p (drop tokens with probability < min_p * max probability; Nguyen et al.,
    2024); softmax. Rows with temperature 0 get a one-hot at `logits.argmax(-1)` (ties ->
    lowest token id).

    Args:
        logits: [num_rows, vocab_size], any float dtype; -inf entries are allowed as long as
            one entry per row is finite.
        st: `num_rows` rows of sampling parameters.

    Returns:
        [num_rows, vocab_size] float32, rows sum to 1.

    Raises:
        ValueError: if `logits` is not 2-D or its row count differs from `st.num_rows`.
    """
    if logits.dim() != 2 or logits.shape[0] != st.num_rows:
        raise ValueError(f"logits must have shape [num_rows={st.num_rows}, vocab_size], "
                         f"got {tuple(logits.shape)}")
    if st.all_greedy:
        return _one_hot_argmax(logits)
    temperature = torch.where(st.is_greedy, 1.0, st.temperature)  # [num_rows]
    # Shifted by the row maximum first: a tiny temperature then sends every other entry to
    # -inf and the maximum stays 0, where logits / 1e-39 alone overflow to inf and softmax
    # gives NaN. Softmax is shift-invariant, so every other temperature samples the same p.
    logits32 = logits.float()  # [num_rows, vocab_size]
    scaled = (logits32 - logits32.amax(dim=-1, keepdim=True)) / temperature[:, None]
    if st.any_top_k or st.any_top_p:
        scaled = _apply_top_k_top_p(scaled, st)
    probs = scaled.softmax(dim=-1)  # [num_rows, vocab_size]
    if st.any_min_p:
        probs = _apply_min_p(probs, st.min_p)
    return _set_greedy_rows(probs, logits, st.is_greedy)


def _one_hot_argmax(logits: Tensor) -> Tensor:
    token_ids = argmax(logits)[:, None]  # [num_rows, 1]
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(1, token_ids, 1.0)


def _set_greedy_rows(probs: Tensor, logits: Tensor, is_greedy: Tensor) -> Tensor:
    """Replace greedy rows of probs by a one-hot at the argmax of the raw logits, in O(rows)
    extra memory."""
    token_ids = argmax(logits)[:, None]  # [num_rows, 1]
    probs = probs.masked_fill(is_greedy[:, None], 0.0)
    at_argmax = torch.where(is_greedy[:, None], 1.0, probs.gather(1, token_ids))  # [rows, 1]
    return probs.scatter_(1, token_ids, at_argmax)


def _apply_top_k_top_p(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Mask (to -inf) tokens outside the top-k and the top-p nucleus. [num_rows, vocab_size]."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if st.any_top_k:
        top_k = torch.where(st.top_k > 0, st.top_k, vocab_size).clamp(1, vocab_size)
        ranks = torch.arange(vocab_size, device=logits.device)  # [vocab_size]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if st.any_top_p:
        sorted_probs = sorted_logits.softmax(dim=-1)  # [num_rows, vocab_size]
        cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of higher-ranked tokens
        drop = (cum_before >= st.top_p[:, None]) & (st.top_p < 1.0)[:, None]
        drop[:, 0] = False  # the top token is always kept
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Zero tokens with prob < min_p * max prob and renormalise. [num_rows, vocab_size]."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def compute_logprobs(logits: Tensor, token_ids: Tensor,
                     num_top: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities of `token_ids` and the `num_top` most likely tokens per row.

    Uses the raw `log_softmax` of the unprocessed logits (no temperature or filters), as vLLM
    does by default.

    Args:
        logits: [num_rows, vocab_size], any float dtype.
        token_ids: [num_rows] integer token ids (e.g. the emitted tokens).
        num_top: number of top alternatives, 0 <= num_top <= vocab_size.

    Returns:
        (token_logprobs [num_rows] float32, top_ids [num_rows, num_top] int64 sorted by
        decreasing logprob, top_logprobs [num_rows, num_top] float32).

    Raises:
        ValueError: on shape mismatch or `num_top` out of range.
    """
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [num_rows, vocab_size] and token_ids [num_rows], got "
                         f"{tuple(logits.shape)} and {tuple(token_ids.shape)}")
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"invalid num_top={num_top}: must be in [0, {logits.shape[1]}]")
    logprobs = logits.float().log_softmax(dim=-1)  # [num_rows, vocab_size]
    token_logprobs = logprobs.gather(1, token_ids.long()[:, None]).squeeze(1)  # [num_rows]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [num_rows, num_top]
    return token_logprobs, top_ids, top_logprobs


@dataclass(slots=True)
class RandomDraws:
    """Random numbers for one sampling or verification step.

    Attributes:
        uniforms: [num_rows, num_uniforms] float32 in [0, 1).
        exponentials: [num_rows, *exponential_shape] float32, Exp(1), clamped to >= the
            smallest positive float32.
    """

    uniforms: Tensor
    exponentials: Tensor


def draw_random(generators: list[torch.Generator | None], num_uniforms: int,
                exponential_shape: tuple[int, ...],
                device: torch.device | str) -> RandomDraws:
    """Draw uniforms and exponentials for each row from that row's generator.

    Draw order (fixed, so a seeded generator reproduces results): rows that share one
    generator object (or all rows with None, which share the device's default generator) are
    drawn as a block in row order: first `torch.rand([n, num_uniforms])`, then
    `exponential_` on `[n, *exponential_shape]`. A row with its own generator therefore draws
    uniforms [num_uniforms] then exponentials [*exponential_shape], independently of the other
    rows in the batch. Nothing is drawn for an empty shape.

    Args:
        generators: one per row; each must live on `device`'s type.
        num_uniforms: uniforms per row (e.g. K for acceptance tests).
        exponential_shape: exponentials per row (e.g. (K + 1, vocab_size)).
        device: where to draw (the logits' device).

    Returns:
        RandomDraws with uniforms [num_rows, num_uniforms] and exponentials
        [num_rows, *exponential_shape].

    Raises:
        RuntimeError: from torch if a generator is on another device type.
    """
    num_rows = len(generators)
    uniforms = torch.empty((num_rows, num_uniforms), dtype=torch.float32, device=device)
    exponentials = torch.empty((num_rows, *exponential_shape), dtype=torch.float32,
                               device=device)
    groups = _group_rows(generators)
    if len(groups) == 1:  # common case: one shared generator (or all None), no scatter
        _fill(uniforms, exponentials, groups[0][0])
    else:
        for generator, rows in groups:
            index = torch.tensor(rows, dtype=torch.int64, device=device)  # [n]
            block_u = uniforms.new_empty((len(rows), num_uniforms))
            block_e = exponentials.new_empty((len(rows), *exponential_shape))
            _fill(block_u, block_e, generator)
            uniforms.index_copy_(0, index, block_u)
            exponentials.index_copy_(0, index, block_e)
    return RandomDraws(uniforms, exponentials.clamp_min_(_TINY))


def _group_rows(generators: list[torch.Generator | None]
                ) -> list[tuple[torch.Generator | None, list[int]]]:
    """Rows grouped by generator identity, groups in order of first appearance."""
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, generator in enumerate(generators):
        groups.setdefault(id(generator), (generator, []))[1].append(row)
    return list(groups.values())


def _fill(uniforms: Tensor, exponentials: Tensor, generator: torch.Generator | None) -> None:
    if uniforms.numel():
        uniforms.uniform_(0.0, 1.0, generator=generator)
    if exponentials.numel():
        exponentials.exponential_(1.0, generator=generator)


def draw_exponentials(generators: list[torch.Generator | None], shape: tuple[int, ...],
                      device: torch.device | str) -> Tensor:
    """Exp(1) draws [num_rows, *shape] float32, one block per row from its generator.

    Same order as `draw_random` with no uniforms.
    """
    return draw_random(generators, 0, shape, device).exponentials


def exponential_race(probs: Tensor, exponentials: Tensor) -> Tensor:
    """argmax(probs / exponentials, -1): a Categorical(probs) sample per row.

    Exact (equivalent to `torch.multinomial`) when `exponentials` are i.i.d. Exp(1) and
    independent of `probs`; `probs` need not be normalised. See the module docstring.

    Args:
        probs: [..., vocab_size] non-negative, at least one positive entry per row.
        exponentials: same shape, positive.

    Returns:
        [...] int64 token ids.
    """
    return argmax(probs / exponentials)


def sample_from_probs(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """Sample one token per row from `probs` by the exponential race.

    Draws exponentials [vocab_size] per row from `generators[row]` (order as in `draw_random`).

    Args:
        probs: [num_rows, vocab_size] float, non-negative, at least one positive entry per row.
        generators: one `torch.Generator | None` per row, on `probs`' device type.

    Returns:
        [num_rows] int64 token ids.

    Raises:
        ValueError: if `probs` is not 2-D or `len(generators) != num_rows`.
    """
    if probs.dim() != 2 or len(generators) != probs.shape[0]:
        raise ValueError(f"expected probs [num_rows, vocab_size] and one generator per row, got "
                         f"{tuple(probs.shape)} and {len(generators)} generators")
    exponentials = draw_exponentials(generators, (probs.shape[1],), probs.device)
    return exponential_race(probs.float(), exponentials)
