"""The bandwidth roofline of decoding: tokens/s <= read bandwidth / bytes read per token;
and the probes of what bounds a step on this machine: read bandwidth, multiply-add peak,
last-level cache."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from specmoe.layers.embed_head import TiedProjection, VocabEmbedding
from specmoe.utils import hugepages

PROBE_BYTES = 1 << 30  # a quick probe's buffer: 32x the last-level cache here


def measure_read_bandwidth(num_bytes: int = 2 << 30, repeats: int = 5,
                           device: torch.device | str = "cpu") -> float:
    """Best-of-`repeats` bytes/s of streaming a `num_bytes` float32 buffer through a sum
    (far larger than the last-level cache, so it measures memory, not cache). On CPU the
    buffer lies in huge pages where available, as the weights do (`specmoe.utils.hugepages`),
    so that the probe measures the memory, not the TLB."""
    if torch.device(device).type == "cpu":
        buf = hugepages.zeros_many([((num_bytes // 4,), torch.float32)])[0].fill_(1.0)
    else:
        buf = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum().item()
        best = min(best, time.perf_counter() - t)
    del buf
    return num_bytes / best


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer except embedding
    tables (a step reads one row; a tied LM head reads all of it) and RoPE tables. Routed experts of MoE layers count in
    full, so for an MoE this is an upper bound."""
    skip = {id(p) for m in model.modules() if isinstance(m, VocabEmbedding)
            for p in m.parameters()}
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    total += sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                 if not name.endswith(("cos", "sin")))
    # A head tied to the embedding reads the whole table.
    total += sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                 if isinstance(m, TiedProjection))
    return total


def measure_peak_flops(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[float, str]:
    """This device's matmul peak in `dtype`, flop/s, and how it was probed: on CPU the
    vector unit's multiply-add peak (`specmoe.kernels.peak`: bf16 `dot_pairs` for bf16 and
    fp16, FMAs for fp32); where that kernel cannot be built, or on a GPU, the best of
    large `torch.matmul` calls (an achieved rate, so below the peak)."""
    if torch.device(device).type == "cpu":
        from specmoe.kernels.peak import vector_peak_flops
        rate = vector_peak_flops(bf16=dtype is not torch.float32)
        if rate is not None:
            kind = "fp32 FMAs" if dtype is torch.float32 else "bf16 dot products"
            return rate, f"{kind} on {torch.get_num_threads()} threads, no memory traffic"
    n = 1024 if torch.device(device).type == "cpu" else 8192
    a = torch.ones(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(4):
        _sync(device)
        t = time.perf_counter()
        torch.matmul(a, a)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best, f"best of {n}x{n} {str(dtype).removeprefix('torch.')} matmuls"


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def last_level_cache_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of the last-level cache (CPU: the highest cache level of cpu0 in sysfs; GPU: its
    L2), or 0 when unknown."""
    if torch.device(device).type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    best = (0, 0)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = _parse_size((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        best = max(best, (level, size))
    return best[1]


def _parse_size(text: str) -> int:
    """sysfs cache sizes: '32768K', '1M' or a plain byte count."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
