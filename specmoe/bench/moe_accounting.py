"""What a `specmoe bench moe` point reads and multiplies, and how its times compare with the
floors of the same run: distinct experts, bytes of a layer and of a whole-model forward,
active parameters, and the roofline targets."""

from __future__ import annotations

import statistics

import numpy as np
import torch
from torch import nn

from specmoe.bench.roofline import weight_bytes_per_token
from specmoe.bench.throughput_floor import MatmulCounts
from specmoe.config import ArchConfig, MoEConfig
from specmoe.layers.moe.backends import moe_blocks
from specmoe.layers.moe.block import SparseMoEBlock

# Issue 24's targets: (kind, applies to T, required fraction).
BANDWIDTH_TARGET_MAX_T, BANDWIDTH_TARGET = 9, 0.85
FLOOR_TARGET_MIN_T, FLOOR_TARGET = 80, 0.80
TARGETS_TEXT = (f"T <= {BANDWIDTH_TARGET_MAX_T}: >= {BANDWIDTH_TARGET:.0%} of the bandwidth "
                f"roofline of the bytes read; T >= {FLOOR_TARGET_MIN_T}: >= {FLOOR_TARGET:.0%} "
                "of the larger floor")



def unique_experts(ids: np.ndarray | torch.Tensor) -> int:
    """Distinct expert ids in one layer's [T, k] routing (the experts whose weights the
    layer reads)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return int(np.unique(ids).size)


def expert_bytes(block: SparseMoEBlock) -> int:
    """Bytes of one routed expert of `block` (its gate, up and down projections) as stored:
    an expert width padded to a multiple of 16 counts its zero padding, which the kernels
    read too."""
    e = block.experts
    return (e.w13[0].numel() * e.w13.element_size()
            + e.w2[0].numel() * e.w2.element_size())


def layer_fixed_bytes(block: SparseMoEBlock) -> int:
    """Bytes of `block`'s weights that every forward reads: router, shared expert and its
    gate (everything but the routed experts)."""
    routed = {id(block.experts.w13), id(block.experts.w2)}
    return sum(p.numel() * p.element_size() for p in block.parameters() if id(p) not in routed)


def layer_bytes(block: SparseMoEBlock, num_unique: int) -> int:
    """Bytes one forward of `block` reads when its tokens touch `num_unique` experts."""
    return layer_fixed_bytes(block) + num_unique * expert_bytes(block)


def layer_active_params(hidden_size: int, moe: MoEConfig) -> int:
    """Matmul weights one token meets in a MoE layer: the router, the shared expert and its
    gate, and top_k routed experts."""
    shared = 3 * hidden_size * moe.shared_expert_intermediate_size
    shared += hidden_size if moe.shared_expert_intermediate_size and moe.has_shared_expert_gate \
        else 0
    return hidden_size * moe.num_experts + shared \
        + moe.top_k * 3 * hidden_size * moe.moe_intermediate_size


def model_bytes(model: nn.Module, arch: ArchConfig, unique_per_layer: list[int],
                num_distinct_tokens: int, context_len: int, num_tokens: int,
                dtype_bytes: int) -> tuple[int, int]:
    """(expert bytes, other bytes) one whole-model forward reads: the distinct experts of
    every MoE layer; every other weight (`weight_bytes_per_token` without the routed
    experts), the embedding rows of the distinct tokens, and each layer's KV cache over
    context_len + num_tokens positions."""
    blocks = moe_blocks(model)
    if len(blocks) != len(unique_per_layer):
        raise ValueError(f"{len(unique_per_layer)} unique counts for {len(blocks)} MoE layers")
    all_experts = sum(b.experts.num_experts * expert_bytes(b) for b in blocks)
    experts = sum(u * expert_bytes(b) for b, u in zip(blocks, unique_per_layer))
    kv = (arch.num_hidden_layers * (context_len + num_tokens)
          * arch.kv_cache_values_per_token * dtype_bytes)
    other = (weight_bytes_per_token(model) - all_experts
             + num_distinct_tokens * arch.hidden_size * dtype_bytes + kv)
    return experts, other


def model_active_params(arch: ArchConfig) -> int:
    """Matmul weights one token meets in the whole model, LM head included."""
    counts = MatmulCounts.from_arch(arch)
    return counts.body_params + counts.head_params


def target_of(num_tokens: int, bandwidth_fraction: float, floor_fraction: float
              ) -> dict | None:
    """Issue 24's target at this T, with the value reached, or None between the two
    ranges."""
    if num_tokens <= BANDWIDTH_TARGET_MAX_T:
        kind, required, value = "bandwidth", BANDWIDTH_TARGET, bandwidth_fraction
    elif num_tokens >= FLOOR_TARGET_MIN_T:
        kind, required, value = "floor", FLOOR_TARGET, floor_fraction
    else:
        return None
    return {"kind": kind, "required": required, "value": value, "passed": value >= required}


def backend_stats(seconds: list[float], bytes_per_rep: list[float], flops: float,
                  bandwidth: float, peak: float, num_tokens: int,
                  baseline_seconds: list[float]) -> dict:
    """A backend's figures at one point from its per-repetition times. Rates and floors are
    taken per repetition (each with its own routing draw's bytes); "best" is the best
    repetition, as min time is."""
    rates = [b / t for b, t in zip(bytes_per_rep, seconds)]
    floors = [max(b / bandwidth, flops / peak) for b in bytes_per_rep]
    over_floor = [t / f for t, f in zip(seconds, floors)]
    speedups = [base / t for base, t in zip(baseline_seconds, seconds)]
    best_bw, best_floor = max(rates) / bandwidth, 1.0 / min(over_floor)
    return {
        "seconds": seconds, "min_s": min(seconds), "median_s": statistics.median(seconds),
        "gb_s": max(rates) / 1e9, "gb_s_median": statistics.median(rates) / 1e9,
        "bandwidth_fraction": best_bw,
        "gf_s": flops / min(seconds) / 1e9, "peak_fraction": flops / min(seconds) / peak,
        "time_over_floor": min(over_floor),
        "time_over_floor_median": statistics.median(over_floor),
        "floor_fraction": best_floor,
        "speedup_vs_baseline": {"median": statistics.median(speedups), "min": min(speedups),
                                "max": max(speedups)},
        "target": target_of(num_tokens, best_bw, best_floor),
    }
