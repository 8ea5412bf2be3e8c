"""Native CPU kernels, compiled with gcc at first use (see `build`), each beside the
plain-torch reference it replaces. Switch them off with SPECMOE_DISABLE_CPU_KERNELS=1 or
`set_enabled(False)`."""

from specmoe.kernels.gemv import (
    REQUIRED_CPU_FLAGS,
    is_enabled,
    kernel_unavailable_reason,
    set_enabled,
    try_linear_bf16,
)

__all__ = ["REQUIRED_CPU_FLAGS", "is_enabled", "kernel_unavailable_reason", "set_enabled", "try_linear_bf16"]
