"""How much memory this machine can still give a process, for checks made before a large
allocation (a model, a group of worker processes) rather than after the OOM killer."""

from __future__ import annotations

import functools
from pathlib import Path

GIB = 1 << 30


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (the kernel's estimate of what can be
    allocated without swapping: free memory plus reclaimable caches), or None where the
    file does not exist or lacks it (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(need_bytes: float, what: str, available: int | None = None) -> None:
    """Raise ValueError when `need_bytes` exceeds the memory available (`available_bytes`
    unless given); nothing where it cannot be read.

    Args:
        what: names the allocation in the message, e.g. "the weights of /m/x.gguf
            (2.2e9 parameters in bfloat16)".
    """
    available = available_bytes() if available is None else available
    if available is not None and need_bytes > available:
        raise ValueError(f"{what}: {need_bytes / GIB:.1f} GiB needed, {available / GIB:.1f} "
                         "GiB available on this machine")


def release_free_memory() -> None:
    """Hand the C heap's free memory back to the OS (glibc's `malloc_trim(0)`; nothing
    elsewhere). Freed buffers below glibc's mmap threshold (which rises after large frees)
    otherwise stay resident, so a load that frees one layer's full-precision weights after
    another would grow as if it kept them."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none."""
    import ctypes
    import ctypes.util
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
