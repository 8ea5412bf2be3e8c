"""Chat logprobs `bytes` are each token's real bytes (issue 23 D7), not the UTF-8 of its text
decoded alone (U+FFFD for a token holding part of a character). Over a byte-level BPE trained
here on a few sentences, so a multi-byte character is split across tokens."""

from __future__ import annotations

import pytest

from specmoe.entrypoints.openai.token_bytes import TokenBytes

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

TEXT = "naïve café 😀 ✓ déjà vu, crème brûlée"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the cat sat on the mat"] * 20, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_token_bytes_concatenate_to_the_texts_utf8(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    alone = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in t for t in alone)  # some token holds part of a character
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.is_byte_level
    pieces = [token_bytes(i, text) for i, text in zip(ids, alone)]
    assert b"".join(pieces) == TEXT.encode("utf-8")
    assert all(b"\xef\xbf\xbd" not in p for p in pieces)  # no U+FFFD anywhere


def test_without_a_tokenizer_the_bytes_are_the_texts():
    assert TokenBytes(None)(7, "7") == b"7"
