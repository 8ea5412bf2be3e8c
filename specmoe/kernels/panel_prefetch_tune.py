"""Choosing `panel_prefetch`'s setting by measurement: one-row passes of the bf16 linear
kernel over the model's own packed weights, with one-row software prefetch off and on."""

from __future__ import annotations

import logging
import time

import torch

from specmoe.kernels import gemv, panel_prefetch
from specmoe.utils import progress

MIN_TUNE_BYTES = 32 << 20  # less is served from cache at any setting: nothing to tell
TUNE_BYTES = 512 << 20  # the weights one timed pass reads (the first ones, in model order)
TUNE_PASSES = 4  # timed passes per setting, alternating
MARGIN = 0.03  # software prefetch must be this much faster to be turned on

logger = logging.getLogger(__name__)


def tune(packed: list[torch.Tensor]) -> dict:
    """Choose the setting once per process: from SPECMOE_ONE_ROW_PREFETCH if set, else by
    timing one-row passes over `packed` (bf16 panel tensors [..., P, J, 64, 2] from
    `gemv.pack_weight`; the first `TUNE_BYTES` of them) with it off and on, `TUNE_PASSES`
    times each, interleaved after a warm-up pass each way. Skipped (the setting kept) after
    a first decision, with the linear kernel unavailable, or with under `MIN_TUNE_BYTES` of
    weights. Returns `state()`.

    Raises:
        ValueError: SPECMOE_ONE_ROW_PREFETCH set to anything but 0 or 1.
    """
    if panel_prefetch.state()["source"] != "default":
        return panel_prefetch.state()
    forced = panel_prefetch.from_env()
    if forced is not None:
        panel_prefetch.set_enabled(forced, "env")
        return panel_prefetch.state()
    calls = _calls(packed)
    nbytes = sum(w.nbytes for w, _ in calls)
    kernel = gemv._lazy.get() if nbytes >= MIN_TUNE_BYTES and gemv.is_enabled() else None
    if kernel is None:
        return panel_prefetch.state()
    best = {False: float("inf"), True: float("inf")}
    with progress.current().phase("timing the one-row weight prefetch (once per process)"):
        for rep in range(TUNE_PASSES + 1):
            for on in (False, True):
                panel_prefetch.set_enabled(on, "default")
                seconds = _timed_pass(kernel, calls)
                if rep:  # the first pass each way warms up
                    best[on] = min(best[on], seconds)
    chosen = best[True] < (1 - MARGIN) * best[False]
    panel_prefetch.set_enabled(chosen, "tuned", off_s=best[False], on_s=best[True],
                               bytes=nbytes)
    logger.info("one-row panel prefetch %s: a one-row pass over %.0f MB of weights took "
                "%.1f ms without, %.1f ms with", "on" if chosen else "off", nbytes / 1e6,
                best[False] * 1e3, best[True] * 1e3)
    return panel_prefetch.state()


def _calls(packed: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(panels of one matrix, x [1, K]) for the first TUNE_BYTES of `packed`, each leading
    index of a stacked (expert) tensor a matrix of its own."""
    calls, total, xs = [], 0, {}
    for tensor in packed:
        if (tensor.dtype is not torch.bfloat16 or tensor.dim() < 4 or not tensor.is_cpu
                or tuple(tensor.shape[-2:]) != (64, 2) or not tensor.is_contiguous()):
            continue  # not bf16 panels
        p, j = tensor.shape[-4], tensor.shape[-3]
        for matrix in tensor.reshape(-1, p, j, 64, 2):
            if total >= TUNE_BYTES:
                return calls
            k = 2 * j
            if k not in xs:
                xs[k] = torch.randn(1, k).to(torch.bfloat16)
            calls.append((matrix, xs[k]))
            total += matrix.nbytes
    return calls


def _timed_pass(kernel, calls) -> float:
    start = time.perf_counter()
    for w, x in calls:
        gemv.run_kernel(kernel, x, w, 64 * w.shape[0], None)
    return time.perf_counter() - start
