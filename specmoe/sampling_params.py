"""Per-request sampling parameters (L0 contract: no torch).

The same parameters are applied identically with and without speculation: the target
distribution p that the rejection sampler verifies against is the one plain sampling draws from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Upper bounds that keep every value inside what the sampler and proposers handle: a
# temperature beyond OpenAI's 2 is allowed up to 100 (flat beyond that anyway); K beyond 64
# would only allocate drafts that are never accepted.
MAX_TEMPERATURE = 100.0
MAX_SPECULATIVE_TOKENS = 64


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax). A finite number in
            [0, MAX_TEMPERATURE].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        top_p: nucleus sampling, keep the smallest set with cumulative probability >= top_p;
            in (0, 1], 1 disables.
        min_p: drop tokens whose probability is below min_p * max probability; in [0, 1].
        seed: per-request seed in [0, 2**63); the same seed and inputs reproduce the same
            output.
        max_tokens: maximum number of generated tokens (>= 1).
        stop: stop strings; the text is cut before the earliest one, which is not returned.
        stop_token_ids: token ids that end generation (kept in `token_ids`, like EOS).
        ignore_eos: keep generating after the end-of-sequence token.
        logprobs: None for no log-probabilities; N >= 0 returns the target model's logprob of
            each emitted token plus the N most likely alternatives.
        num_speculative_tokens: per-request override of K (0 turns speculation off); None uses
            the engine's setting; at most MAX_SPECULATIVE_TOKENS.

    Model-independent checks (types, finiteness, ranges) run here; the checks against the
    loaded model (vocabulary, context, the smallest safe temperature) run in
    `specmoe.engine.validation.RequestValidator`, shared by the Python API and the server.

    Raises:
        ValueError: naming the bad field and the accepted range (also for a wrong type: a
            bool or a string where a number belongs, NaN or infinity).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # None means "none", as in the OpenAI API, where `stop: null` is the default.
        self.stop = [] if self.stop is None else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop = list(self.stop or []) if _is_sequence(self.stop) else self.stop
        self.stop_token_ids = (list(self.stop_token_ids or [])
                               if _is_sequence(self.stop_token_ids) else self.stop_token_ids)
        _check(_is_real(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
               "temperature", self.temperature,
               f"a finite number in [0, {MAX_TEMPERATURE:g}] (0 is greedy)")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0), "top_k",
               self.top_k, "0 or -1 (off) or an integer >= 1")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
               self.seed, "None or an integer in [0, 2**63)")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               self.max_tokens, "an integer >= 1")
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
               "logprobs", self.logprobs, "None or an integer >= 0")
        _check(_is_sequence(self.stop) and all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "non-empty strings")
        _check(_is_sequence(self.stop_token_ids)
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "non-negative integers")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        _check(self.num_speculative_tokens is None
               or (_is_int(self.num_speculative_tokens)
                   and 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS),
               "num_speculative_tokens", self.num_speculative_tokens,
               f"None or an integer in [0, {MAX_SPECULATIVE_TOKENS}]")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    """A finite int or float (not a bool, which Python counts as an int)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def _is_sequence(v: object) -> bool:
    return isinstance(v, (list, tuple))


def _check(ok: bool, name: str, value: object, accepted: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: must be {accepted}")
