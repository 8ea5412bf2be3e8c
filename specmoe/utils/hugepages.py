"""CPU weights in transparent huge pages.

Decoding streams every weight from memory each step. In 4 KiB pages that is one TLB entry
per 4 KiB read; where Linux enables transparent huge pages only on request
(`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the common default), torch's
allocations never get 2 MiB pages. `zeros_many` maps one anonymous region aligned to 2 MiB,
advises `MADV_HUGEPAGE` on it and places the tensors in it back to back (so small tensors
waste no page), each with a storage of its own; `rehome_module` moves a module's CPU
parameters and buffers there, so the linear kernels read the weights faster. The KV cache
is left to torch: its pages are first touched
during prefill, where faulting in 2 MiB at a time cost more than the pages saved.

Where huge pages are not available (not Linux, THP `never`, SPECMOE_DISABLE_HUGE_PAGES=1,
less than MIN_BYTES in all) everything stays with torch's allocator: same values, same
results.
"""

from __future__ import annotations

import ctypes
import mmap

import torch
from torch import nn

from specmoe.utils.env import env_flag

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 << 20  # below this a region is left to torch's allocator
ALIGN = 64  # bytes between tensors of one region (a cache line; a multiple of every itemsize)
DISABLE_ENV = "SPECMOE_DISABLE_HUGE_PAGES"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def supported() -> bool:
    """Whether huge pages can be requested here: Linux with `MADV_HUGEPAGE`, transparent
    huge pages not `never` (THP_ENABLED readable), and SPECMOE_DISABLE_HUGE_PAGES unset or
    0."""
    if env_flag(DISABLE_ENV) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def zeros_many(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zero-filled contiguous CPU tensors of the given (shape, dtype)s, laid out back to back
    (64-byte aligned) in one mapping advised for huge pages. Each has a storage of its own
    (saving or copying one copies only its bytes) that keeps the mapping alive. Plain
    `torch.zeros` each where `in_huge_pages(specs)` is False."""
    plan = _plan(specs)
    if plan is None:
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
    return _carve(specs, *plan)


def in_huge_pages(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> bool:
    """Whether `zeros_many(specs)` maps a huge-page region: `supported()` and at least
    MIN_BYTES in all."""
    return _plan(specs) is not None


def _plan(specs) -> tuple[list[int], int] | None:
    """The region's layout (`_layout`) where `in_huge_pages(specs)`, else None."""
    offsets, total = _layout(specs)
    return (offsets, total) if total >= MIN_BYTES and supported() else None


def _carve(specs, offsets: list[int], total: int) -> list[torch.Tensor]:
    """Zero tensors of `specs` at `offsets` in a fresh huge-page region of `total` bytes."""
    buf, start = _region(total)
    return [torch.frombuffer(buf, dtype=torch.uint8, count=_nbytes(shape, dtype),
                             offset=start + o).view(dtype).view(shape)
            if _nbytes(shape, dtype) else torch.zeros(shape, dtype=dtype)
            for o, (shape, dtype) in zip(offsets, specs)]


def _layout(specs) -> tuple[list[int], int]:
    """Byte offsets of the tensors in a region, and its size."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += _round_up(_nbytes(shape, dtype), ALIGN)
    return offsets, total


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _region(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping (zeros) and the offset in it of a 2 MiB-aligned run of
    `nbytes`, advised for huge pages up to the next 2 MiB boundary. The mapping is one huge
    page longer than that run so that an aligned start exists; the slack is never touched,
    so it costs address space, not memory."""
    span = _round_up(nbytes, HUGE_PAGE)
    buf = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, span)
    except OSError:
        pass  # the mapping still works, with 4 KiB pages
    return buf, start


def rehome_module(module: nn.Module) -> int:
    """Copy the storages of `module`'s CPU parameters and buffers into one huge-page region
    (`zeros_many`) and point every tensor on them at the copy, keeping its offset, shape,
    strides and dtype (tied weights and views stay shared); and copy the tensors a submodule
    lists in `extra_weights()`, handed back to its `set_extra_weights(copies)` (the int4
    kernel's own packed copy). Call it once, after loading: a second call copies again.

    Returns:
        bytes copied (0 where `in_huge_pages` is False: nothing is moved).
    """
    users: dict[int, list[torch.Tensor]] = {}  # storage address -> tensors on it
    storages: dict[int, torch.UntypedStorage] = {}
    for sub in module.modules():
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is not None and t.device.type == "cpu" and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                users.setdefault(key, []).append(t)
                storages[key] = t.untyped_storage()
    extras = [(sub, sub.extra_weights()) for sub in module.modules()
              if hasattr(sub, "extra_weights")]
    specs = ([((s.nbytes(),), torch.uint8) for s in storages.values()]
             + [(tuple(t.shape), t.dtype) for _, ts in extras for t in ts])
    plan = _plan(specs)  # one check: zeros_many would make it again
    if plan is None:
        return 0
    copies = iter(_carve(specs, *plan))
    moved = sum(n for (n,), _ in specs)
    # Each old storage is dropped right after its copy (popped, no reference kept), so memory
    # peaks at the model plus one storage, not twice the model: the region's pages are
    # touched only as they are copied into.
    for key in list(storages):  # in the order of `specs`
        storage = storages.pop(key)
        region = next(copies)
        region.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        del storage
        for t in users.pop(key):
            t.data = torch.empty(0, dtype=t.dtype).set_(
                region.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    while extras:
        sub, ts = extras.pop(0)
        sub.set_extra_weights([next(copies).copy_(t) for t in ts])
    return moved
