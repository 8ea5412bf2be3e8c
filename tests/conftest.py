"""Shared fixtures, and the `slow` marker on every test that loads a real model."""

from __future__ import annotations

import os

import pytest
from kernel_checks import require_kernel
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


@pytest.fixture
def enabled(request):
    """The test module's native kernel switched on for one test, skipped where it cannot be
    built. It fails where the machine builds kernels
    (tests/kernel_checks.py). The module names its kernel by KERNEL_UNAVAILABLE_REASON: a function returning
    None once the kernel is loaded, else why not (building it if needed)."""
    require_kernel(f"{request.module.__name__}'s kernel",
                   request.module.KERNEL_UNAVAILABLE_REASON())
    from specmoe import kernels
    was = kernels.is_enabled()
    kernels.set_enabled(True)
    yield
    kernels.set_enabled(was)


# Fixtures that load (or serve) a real model: a test using one is marked slow, so
# `make test-fast` (pytest -m "not slow") leaves it out. Modules that time a grid or train
# mark themselves (`@pytest.mark.slow`).
REAL_MODEL_FIXTURES = {"smollm2"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
