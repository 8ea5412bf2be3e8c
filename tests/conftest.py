"""Shared fixtures, the `slow` marker on every test that loads a real model, and a KV cache
budget sized for tests."""

from __future__ import annotations

import gc
import os

# Each engine allocates (and zeroes) its KV cache; at the engines' default of 1 GiB, a test
# holding a target, a draft and `with_speculative` copies reached several GiB. 256 MiB hold
# every test's requests; a test that wants another size passes its own. Subprocesses that
# tests start inherit it.
os.environ.setdefault("SPECMOE_KV_CACHE_SPACE", "0.25")
os.environ.setdefault("SPECMOE_TOKENIZER_CACHE_DIR", "off")  # tests never write to ~/.cache

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


def pytest_terminal_summary(terminalreporter):
    """The run's peak memory (`make test` is held to 6 GiB, `make test-fast` to 3 GiB):
    this process's resident set and the largest of the processes it started and waited
    for (servers, expert-parallel ranks)."""
    import resource
    gib = 1 << 20  # ru_maxrss is in KiB on Linux
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / gib
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / gib
    terminalreporter.write_line(f"peak resident memory: {own:.2f} GiB (pytest), "
                                f"{children:.2f} GiB (largest child process)")


@pytest.fixture(autouse=True)
def _collect_dropped_engines():
    """An engine holds its KV cache inside reference cycles (the speculation policy's
    callbacks into it), so one a test made and dropped is freed only when Python's cycle
    collector next runs, which a test module of large engines outpaces: collect after every
    test."""
    yield
    gc.collect()
