"""Shared fixtures."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The embedded default model's alias. Skips where the model package is missing, but
    fails under CI, whose `make test` installs it."""
    from specmoe.loader.aliases import ALIASES
    try:
        ALIASES["smollm2-135m"].path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2-135M GGUF not installed: {exc}")
    return "smollm2-135m"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one intra-op thread for a module of tiny models or tensors: more threads only
    add overhead, and on a busy machine their spin-waiting slows tests by orders of
    magnitude. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
