"""Random tiny models written to disk for tests that need a real checkpoint but no real
weights (engine, server and fuzz tests): they load through the normal HuggingFace-directory
loader in milliseconds."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY_LLAMA = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)


def save_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama (TINY_LLAMA's shape, `overrides` replacing any of its fields) saved as
    a HuggingFace directory at `path`, without tokenizer files; returns `path`."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def random_bf16_experts(n: int, h: int, i: int, seed: int = 0):
    """N random bf16 SwiGLU experts (H=h, I=i) scaled so that activations stay O(1), for the
    expert kernel tests."""
    from specmoe.layers.moe.experts import RoutedExperts
    torch.manual_seed(seed)
    experts = RoutedExperts(n, h, i)
    with torch.no_grad():
        experts.w13.normal_(0, h ** -0.5)
        experts.w2.normal_(0, i ** -0.5)
    return experts.to(torch.bfloat16).requires_grad_(False)
