"""Environment switches."""

from __future__ import annotations

import os


def env_flag(name: str) -> bool:
    """Whether environment variable `name` is set to 1, true or yes (any case, spaces
    around ignored): specmoe's on/off switches (SPECMOE_DISABLE_CPU_KERNELS,
    SPECMOE_INT4_BATCH_INVARIANT, SPECMOE_DISABLE_HUGE_PAGES, SPECMOE_FIXED_THREADS)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
