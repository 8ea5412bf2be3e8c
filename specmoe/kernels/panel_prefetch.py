"""Whether the bf16 panel kernels (`gemv`, `moe`) prefetch in software when they multiply a
single row: the process-wide setting (`panel_prefetch_tune` measures which is faster).

Decoding one token at a time puts one row through every weight panel. Passes of two or more
rows prefetch the panel 4 KB ahead into L2; whether a one-row pass should too depends on the
memory system: on a 2-core Zen 4 the hardware prefetcher alone kept its single stream at
the bandwidth probe (79-83 GB/s; software prefetch on top 74-78), while on a 2-core Xeon
(22-25 GB/s probe) one row read 17 GB/s without it and 25 with it, and ran slower than two
rows. Neither choice is right everywhere, so `panel_prefetch_tune.tune` times one-row
passes over the model's own packed weights both ways (interleaved, the minimum of several
passes) when the first model large enough to tell is loaded, and keeps the faster. The
environment variable SPECMOE_ONE_ROW_PREFETCH=0 or 1 sets it instead. The outputs have the
same bits either way: a prefetch moves no data into a result.
"""

from __future__ import annotations

import ctypes
import os

ENV = "SPECMOE_ONE_ROW_PREFETCH"

_libraries: list[ctypes.CDLL] = []
_state = {"on": False, "source": "default"}  # source: default, env, or tuned


def register(library: ctypes.CDLL) -> None:
    """Called by a kernel library that includes gemv_panels.h when it is loaded: it gets the
    current setting, and any later change."""
    library.specmoe_set_one_row_prefetch.argtypes = [ctypes.c_int]
    library.specmoe_one_row_prefetch.restype = ctypes.c_int
    library.specmoe_set_one_row_prefetch(int(_state["on"]))
    _libraries.append(library)


def set_enabled(on: bool, source: str = "set", **measured) -> None:
    """Turn one-row software prefetch on or off in every panel kernel, loaded or not;
    `measured` (a tune's timings) goes into `state()` with it."""
    _state.update(on=bool(on), source=source, **measured)
    for library in _libraries:
        library.specmoe_set_one_row_prefetch(int(on))


def state() -> dict:
    """{"on": bool, "source": "default" | "env" | "tuned" | "set", and after a tune
    "off_s" / "on_s" (the fastest pass each way) and "bytes" (read per pass)}."""
    return dict(_state)


def from_env() -> bool | None:
    """SPECMOE_ONE_ROW_PREFETCH as a setting (None: unset or empty).

    Raises:
        ValueError: set to anything but 0 or 1.
    """
    value = os.environ.get(ENV)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"

