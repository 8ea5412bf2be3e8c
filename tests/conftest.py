"""Shared fixtures."""

from __future__ import annotations

import os

import pytest


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
