"""Incremental detokenization: the text of a growing list of output tokens without decoding
the whole list at every step; and `safe_stream_text`, the part of it a stream may show.

Each update decodes only a window: the tokens from `prefix_offset` (the start of the last
emitted chunk, kept as context so merges and leading spaces decode as in the full text) to
the end, and subtracts the decoded window prefix [prefix_offset, read_offset). Text ending in
U+FFFD (an incomplete UTF-8 character) is held back until the character completes. This is the
scheme of vLLM's `detokenize_incrementally` (our own code); a stream of n tokens costs O(n)
token decodes instead of O(n^2).
"""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDetokenizer:
    """Args:
        decode: token ids -> text (the tokenizer's decode, special tokens skipped).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def update(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (the previous call's list with tokens appended), up to the
        last complete character."""
        prefix_text = self.decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self.text


def safe_stream_text(text: str, stop: list[str]) -> str:
    """The prefix of `text` that can be streamed now: without a trailing U+FFFD (an incomplete
    UTF-8 character decodes as one) and without its longest suffix that begins some stop
    string (more tokens may complete that stop string, which the final text cuts). So a
    stream never shows what the non-streamed text would not."""
    text = text.rstrip("\ufffd")
    if not stop:
        return text
    longest = max(len(s) for s in stop)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(s.startswith(tail) for s in stop):
            return text[:start]
    return text
