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
    returns []).

    Every earlier occurrence of the last token ends a candidate match (found in one array
    comparison); the candidates are grown backwards while they match the suffix, latest
    first, until one reaches max_n: the latest of the longest wins. Where a sliding window
    per n (tried from max_n down) cost ~80 us a request on a 300-token context, 4% of a
    SmolLM2 step at eight requests, this costs ~10. `tests/spec_decode/test_ngram.py` holds
    the rule in plain Python and checks the two agree."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"invalid n-gram range [{min_n}, {max_n}]: need 1 <= min <= max")
    if num_tokens <= 0 or len(context) < min_n + 1:
        return [], 0
    arr = np.asarray(context, dtype=np.int64)
    ends = np.flatnonzero(arr[:-1] == arr[-1]).tolist()  # a match's last token
    seq = context if isinstance(context, list) else arr.tolist()  # cheap scalar reads
    cap = min(max_n, len(seq) - 1)
    best, best_end = 0, -1
    for end in reversed(ends):
        n = 1
        while n < cap and n <= end and seq[end - n] == seq[-1 - n]:
            n += 1
        if n > best:
            best, best_end = n, end
            if n == cap:
                break
    if best < min_n:
        return [], 0
    return list(seq[best_end + 1:best_end + 1 + num_tokens]), best


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
            tokens, n = find_ngram_match(r.context, self.min_n, self.max_n,
                                         r.max_num_draft_tokens)
            out.append(DraftProposal(tokens, match_length=n))
        return out

    def free(self, request_id: str) -> None:
        pass
