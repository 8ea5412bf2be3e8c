"""Skip a native-kernel test only where this machine cannot build the kernel.

Where the CPU has AVX-512 and a C compiler is on PATH, every kernel must build: a failed
build there is a defect, so the test fails instead of skipping.
"""

from __future__ import annotations

import os
import shutil

import pytest

from specmoe.kernels.build import cpu_reason

AVX512 = ("avx512f", "avx512bw", "avx512vl")


def machine_builds_kernels() -> bool:
    """The CPU has AVX-512 (F, BW, VL) and `$CC` (default gcc) is on PATH."""
    return cpu_reason(AVX512) is None and shutil.which(os.environ.get("CC", "gcc")) is not None


def require_kernel(what: str, reason: str | None) -> None:
    """Nothing when `reason` is None (the kernel is loaded); else fail where this machine
    builds kernels, skip elsewhere."""
    if reason is None:
        return
    if machine_builds_kernels():
        pytest.fail(f"{what} did not build on a machine with AVX-512 and a compiler: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")
