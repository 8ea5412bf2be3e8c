"""Prompt-lookup (n-gram) drafting: find the latest earlier occurrence of the context's last
n tokens and propose what followed it (Saxena 2023, "Prompt Lookup Decoding"; the `ngram`
method of vLLM and llama.cpp's lookup decoding)."""

from __future__ import annotations

import numpy as np

from specmoe.spec_decode.proposer import DraftProposal, ProposeRequest


def find_ngram_continuation(context: list[int], min_n: int, max_n: int,
                            num_tokens: int) -> list[int]:
    """The continuation of the latest earlier match of the longest suffix n-gram.

    Tries n = max_n down to min_n; for each, looks for the most recent position i with
    context[i:i+n] == context[-n:] and i + n < len(context), and returns up to
    `num_tokens` tokens from context[i+n:]. Returns [] when nothing matches, when the
    context is shorter than n + 1, or when num_tokens <= 0.

    Raises:
        ValueError: unless 1 <= min_n <= max_n.
    """
    return find_ngram_match(context, min_n, max_n, num_tokens)[0]


def find_ngram_match(context: list[int], min_n: int, max_n: int,
                     num_tokens: int) -> tuple[list[int], int]:
    """`find_ngram_continuation` and the length n of the match it continues (0 where it
    returns [])."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"invalid n-gram range [{min_n}, {max_n}]: need 1 <= min <= max")
    if num_tokens <= 0:
        return [], 0
    arr = np.asarray(context, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            tokens = arr[start:start + num_tokens].tolist()
            return tokens, n if tokens else 0
    return [], 0


class NgramProposer:
    """Deterministic proposer (q is one-hot on each proposed token).

    Args:
        min_n: smallest suffix n-gram to match (>= 1).
        max_n: largest suffix n-gram to match; longer ones are tried first.
    """

    name = "ngram"
    stateless = True  # nothing kept between calls: shadow drafts cost one lookup each

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"invalid n-gram range [{min_n}, {max_n}]: need 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, reqs: list[ProposeRequest]) -> list[DraftProposal]:
        """Each request's continuation by `find_ngram_match`, with its match length
        (stateless)."""
        out = []
        for r in reqs:
            tokens, n = find_ngram_match(r.context, self.min_n, self.max_n, r.num_tokens)
            out.append(DraftProposal(tokens, match_length=n))
        return out

    def free(self, request_id: str) -> None:
        pass
