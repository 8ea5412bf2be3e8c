"""The bytes of a token, for OpenAI's logprobs `bytes` field: a token that holds part of a
UTF-8 character decodes alone to U+FFFD, so its bytes come from the vocabulary instead."""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table inverted: the character a byte-level BPE vocabulary
    uses for each byte -> that byte. Printable Latin-1 bytes stand for themselves; the other
    68 bytes are shifted to U+0100 and up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """The bytes of a token id, from the tokenizer's vocabulary (cached per id).

    Byte-level BPE vocabularies (GPT-2, SmolLM2, Qwen, Llama 3) spell each byte as one
    character: mapped back through GPT-2's table. SentencePiece byte-fallback tokens
    ("<0xE2>") are that byte, other SentencePiece pieces their UTF-8 with "▁" as a space.
    Anything else (added tokens outside the byte alphabet, no tokenizer) is the UTF-8 of the
    decoded text.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.is_byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int, text: str) -> bytes:
        """`text` is the token decoded alone (the fallback)."""
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._lookup(token_id, text)
        return out

    def _lookup(self, token_id: int, text: str) -> bytes:
        piece = None
        if self.tokenizer is not None:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
            except Exception:  # noqa: BLE001 - an id outside the vocabulary: the text
                piece = None
        if not isinstance(piece, str) or not piece:
            return text.encode("utf-8", "backslashreplace")
        table = _byte_decoder()
        if self.is_byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        match = _SENTENCEPIECE_BYTE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if not self.is_byte_level:
            return piece.replace("\u2581", " ").encode("utf-8", "backslashreplace")
        return text.encode("utf-8", "backslashreplace")


def _is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level (its vocabulary spells bytes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)
