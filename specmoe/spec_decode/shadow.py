"""Shadow drafts: what a stateless proposer (prompt lookup) would have drafted for a request
the adaptive policy holds at K = 0, checked against the tokens the target then emits.

A held request's acceptance is otherwise learnt only from probes, which verify real drafts
and so cost target rows: the policy spaces them out (`AdaptivePolicy._probe`), and a poor
first estimate can keep a request, or a whole batch, off for good. On SmolLM2-135M with
prompt lookup, half code and half translation prompts at four requests, the policy held
speculation off on 98-100% of request-steps in each repetition of two sweeps (a few probes
at K = 8 brought too little back), where static K = 2 ran 1.00-1.15x plain.

Prompt lookup's proposal costs ~10 us a request and no state, and its drafts are
deterministic (q one-hot), so whether verification would have accepted them can be read
from the tokens the request emits next: a draft d_j is accepted exactly when the target
emits it at that position after d_0..d_{j-1}. Under greedy decoding that is the argmax;
under sampling, verification accepts a one-hot draft with probability p(d_j) (Leviathan et
al. 2023, arXiv 2211.17192, with q(d_j) = 1), the chance that sampling from p emits d_j,
given the same prefix. The accepted count of a shadow proposal is therefore distributed as
that of the same proposal verified, and it costs no target row. Shadows are taken at most
once every `every` tokens of a request; one resolves once a draft differs from the token
emitted in its place or all its drafts are matched.
"""

from __future__ import annotations

from dataclasses import dataclass

# tokens between a request's shadows: a shadow of K <= 8 drafts resolves within 8 tokens,
# so a request held at K = 0 has one open most of the time, at ~10 us each per 8 steps
SHADOW_EVERY = 8


@dataclass(frozen=True, slots=True)
class ShadowOutcome:
    """A resolved shadow proposal: `drafted` tokens proposed where `allowed` were asked
    for, the first `accepted` of them emitted by the target in their places; `match_length`:
    prompt lookup's matched n-gram length (0: nothing matched)."""

    request_id: str
    allowed: int
    drafted: int
    accepted: int
    match_length: int


@dataclass(slots=True)
class _Shadow:
    start: int  # the request's token count when proposed: the drafts' first position
    tokens: list[int]
    allowed: int
    match_length: int


class ShadowDrafts:
    """Outstanding shadow proposals per request, and the token count of each request's last.

    Args:
        every: the least tokens a request emits between two of its shadow proposals (>= 1).
    Raises:
        ValueError: every < 1.
    """

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"invalid shadow interval every={every}: must be >= 1")
        self.every = every
        self._open: dict[str, _Shadow] = {}
        self._last: dict[str, int] = {}

    def due(self, request_id: str, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens (prompt and output) may be shadowed now:
        none of its shadows is open and `every` tokens have passed since its last."""
        if request_id in self._open:
            return False
        last = self._last.get(request_id)
        return last is None or num_tokens - last >= self.every

    def issue(self, request_id: str, num_tokens: int, allowed: int, tokens: list[int],
              match_length: int) -> ShadowOutcome | None:
        """Record a proposal of `tokens` (at most `allowed`) continuing a request's first
        `num_tokens` tokens; an empty one resolves at once (returned: nothing drafted)."""
        self._last[request_id] = num_tokens
        if not tokens:
            return ShadowOutcome(request_id, allowed, 0, 0, match_length)
        self._open[request_id] = _Shadow(num_tokens, list(tokens[:allowed]), allowed,
                                         match_length)
        return None

    def resolve(self, request_id: str, token_ids: list[int]) -> ShadowOutcome | None:
        """The request's open shadow against its tokens so far (`token_ids`: prompt and
        output): its outcome where a draft differs from the token emitted in its place or
        every draft was emitted; None while neither (or no shadow is open)."""
        shadow = self._open.get(request_id)
        if shadow is None:
            return None
        emitted = token_ids[shadow.start:shadow.start + len(shadow.tokens)]
        accepted = 0
        for drafted, actual in zip(shadow.tokens, emitted):
            if drafted != actual:
                break
            accepted += 1
        if accepted == len(emitted) and len(emitted) < len(shadow.tokens):
            return None  # every draft so far emitted, some not yet reached
        del self._open[request_id]
        return ShadowOutcome(request_id, shadow.allowed, len(shadow.tokens), accepted,
                             shadow.match_length)

    @property
    def open_ids(self) -> list[str]:
        """The requests with a shadow open."""
        return list(self._open)

    def forget(self, request_id: str) -> None:
        """The request finished or left: drop its shadow (unresolved ones say nothing: the
        request stopped before their drafts were reached)."""
        self._open.pop(request_id, None)
        self._last.pop(request_id, None)
