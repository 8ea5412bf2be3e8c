"""The bandwidth roofline of decoding: tokens/s <= read bandwidth / bytes read per token."""

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
