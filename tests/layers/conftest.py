"""Fixtures shared by the layer tests."""

from __future__ import annotations

import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Qwen2 checkpoint (HF directory) whose projections int4 can tile."""
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)
