"""Incremental detokenization gives the full decode's text, whatever the chunking, on real
tokenizers and multi-byte characters."""

from __future__ import annotations

import random

import pytest

from specmoe.engine.detokenizer import IncrementalDetokenizer

TEXT = ("def naïve(x):\n    return x  # déjà vu → ok ✓ 你好，世界 🙂🚀\n"
        "  Spaces   and\ttabs; émoji 👩‍💻 end.")


@pytest.fixture(scope="module", params=["tiny-moe", "smollm2-135m"])
def tokenizer(request):
    from specmoe.loader.model_loader import load_model
    from specmoe.config import ModelConfig
    try:
        return load_model(ModelConfig(request.param)).load_tokenizer()
    except FileNotFoundError as exc:
        pytest.skip(f"{request.param} not installed: {exc}")


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_text_equals_full_decode(tokenizer, seed):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    decode = _decode(tokenizer)
    detok = IncrementalDetokenizer(decode)
    rng = random.Random(seed)
    n = 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 6))   # speculation appends several at once
        text = detok.update(ids[:n])
        full = decode(ids[:n])
        if not full.endswith("\ufffd"):
            assert text == full
        else:
            assert full.startswith(text) and "\ufffd" not in text
    assert detok.text == decode(ids) == TEXT


def test_one_token_at_a_time_decodes_few_tokens_per_step(tokenizer):
    ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)
    calls = []
    decode = _decode(tokenizer)
    detok = IncrementalDetokenizer(lambda x: calls.append(len(x)) or decode(x))
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n])
    assert detok.text == decode(ids)
    assert max(calls) < 16   # windows, never the whole list
