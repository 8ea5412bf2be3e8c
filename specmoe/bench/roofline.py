"""The bandwidth roofline of decoding: tokens/s <= read bandwidth / bytes read per token;
and the probes of the machine's limits: read bandwidth, best multiply rate."""

from __future__ import annotations

import time

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
    """The best multiply rate probed on this device, flop/s, and which probe gave it.

    On CPU: the vector unit's multiply-add peak for bf16 dot products and for fp32 FMAs
    (`specmoe.kernels.peak`, where it builds), and large `torch.matmul` calls in `dtype` and
    in bf16 (which reach units such as AMX that our kernels do not use); on a GPU, the
    matmuls. The highest is taken, whatever the run's dtype, since quantised paths may
    multiply in bf16: a floor computed at this rate is only beaten by multiplying faster
    than anything probed."""
    probes = []
    if torch.device(device).type == "cpu":
        from specmoe.kernels.peak import vector_peak_flops
        for bf16, kind in ((True, "bf16 dot products"), (False, "fp32 FMAs")):
            rate = vector_peak_flops(bf16=bf16)
            if rate is not None:
                probes.append((rate, f"{kind} on {torch.get_num_threads()} threads, no memory "
                                     "traffic"))
    for t in {dtype, torch.bfloat16}:
        probes.append(_matmul_rate(t, device))
    return max(probes)


def _matmul_rate(dtype: torch.dtype, device: torch.device | str) -> tuple[float, str]:
    """Best flop/s of four n x n x n torch.matmul calls (n = 1024 on CPU, 8192 on GPU)."""
    n = 1024 if torch.device(device).type == "cpu" else 8192
    a = torch.ones(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(4):
        synchronize(device)
        t = time.perf_counter()
        torch.matmul(a, a)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best, f"{n}x{n} {str(dtype).removeprefix('torch.')} torch.matmul"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
