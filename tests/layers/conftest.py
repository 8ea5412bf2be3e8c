"""Fixtures shared by the layer tests."""

from __future__ import annotations

import contextlib

import pytest
from kernel_checks import require_kernel
import torch
import transformers

from specmoe import kernels
from specmoe.kernels.build import KernelBuildError


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


@contextlib.contextmanager
def _kernels_off():
    was = kernels.is_enabled()
    kernels.set_enabled(False)
    try:
        yield
    finally:
        kernels.set_enabled(was)


def _load_fma_variant(load_kernel):
    try:
        return load_kernel(("-mno-avx512bf16",))
    except KernelBuildError as exc:
        require_kernel("FMA variant", str(exc))


@pytest.fixture
def fma_variant():
    """load_kernel -> that kernel built without AVX512-BF16 (its shift + FMA path), or the
    test skipped where that build fails."""
    return _load_fma_variant


@pytest.fixture
def kernels_off():
    """A context manager inside which the native kernels are off (the torch references run)."""
    return _kernels_off
