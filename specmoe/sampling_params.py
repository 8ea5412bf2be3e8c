"""Per-request sampling parameters (L0 contract: no torch).

The same parameters are applied identically with and without speculation: the target
distribution p that the rejection sampler verifies against is the one plain sampling draws from.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax). Must be >= 0.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        top_p: nucleus sampling, keep the smallest set with cumulative probability >= top_p;
            in (0, 1], 1 disables.
        min_p: drop tokens whose probability is below min_p * max probability; in [0, 1].
        seed: per-request seed; the same seed and inputs reproduce the same output.
        max_tokens: maximum number of generated tokens (>= 1).
        stop: stop strings; the text is cut before the earliest one, which is not returned.
        stop_token_ids: token ids that end generation (kept in `token_ids`, like EOS).
        ignore_eos: keep generating after the end-of-sequence token.
        logprobs: None for no log-probabilities; N >= 0 returns the target model's logprob of
            each emitted token plus the N most likely alternatives.
        num_speculative_tokens: per-request override of K (0 turns speculation off); None uses
            the engine's setting.

    Raises:
        ValueError: naming the bad field and the accepted range.
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
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 is greedy)")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k, "0 or -1 (off) or >= 1")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
               and self.max_tokens >= 1, "max_tokens",
               self.max_tokens, "an integer >= 1")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs,
               "None or >= 0")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "non-negative integers")
        _check(self.num_speculative_tokens is None or self.num_speculative_tokens >= 0,
               "num_speculative_tokens", self.num_speculative_tokens, "None or >= 0")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0


def _check(ok: bool, name: str, value: object, accepted: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: must be {accepted}")
