"""Timing harness of Tt(B, T): synthetic presets, replayed routing reaches the experts, grid
bookkeeping, and preset sizes."""

from __future__ import annotations

import pytest
import torch

from specmoe.analysis.presets import (PRESETS, Preset, check_preset_sizes, preset_size)
from specmoe.analysis.routing_gen import CorrelatedRouting
from specmoe.analysis.verify_cost import VerifyCostBench, build_synthetic, measure_grid
from specmoe.layers.moe.backends import expert_stats, moe_blocks
from specmoe.layers.moe.stats import ExpertStatsRecorder
from specmoe.models.decoder import DecoderModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL_MOE = Preset("small-moe", "test", num_experts=8, top_k=2, intermediate_size=32,
                   num_layers=2, hidden_size=256)
SMALL_DENSE = Preset("small-dense", "test", 0, 0, 64, num_layers=2, hidden_size=256)


def test_synthetic_model_has_the_preset_shape_and_finite_weights():
    runner = build_synthetic(SMALL_MOE, dtype="float32")
    params = dict(runner.model.named_parameters())
    assert sum(p.numel() for p in params.values()) == preset_size(SMALL_MOE).total_params
    assert all(torch.isfinite(p).all() for p in params.values())
    assert all(p.dtype == torch.float32 for p in params.values())
    norms = [p for n, p in params.items() if "norm" in n]
    assert norms and all((p == 1).all() for p in norms)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_size_counts_every_parameter_of_the_full_size_model(name):
    """Every preset at full size (DeepSeek's MLA, shared expert and dense first layer
    included), built on the meta device: the real shapes, no memory."""
    preset = PRESETS[name]
    with torch.device("meta"):
        model = DecoderModel(preset.arch(), 64)
    assert sum(p.numel() for p in model.parameters()) == preset_size(preset).total_params


def test_replayed_routing_is_what_the_experts_receive():
    runner = build_synthetic(SMALL_MOE, dtype="float32")
    recorder = ExpertStatsRecorder()
    bench = VerifyCostBench(runner, CorrelatedRouting(8, 2, 0.5), context_len=20,
                            max_batch_size=3, max_num_tokens=4)
    expert_stats(runner.model).subscribe(recorder)
    seconds, unique = bench.time_forward(3, 4)
    assert seconds > 0
    for block in moe_blocks(runner.model):
        given = block.router.next_ids
        assert torch.equal(recorder.routing[block.layer_idx][-1], given)
        assert given.shape == (12, 2)
    counts = [recorder.unique_experts[b.layer_idx][-1] for b in moe_blocks(runner.model)]
    assert unique == counts


def test_own_router_routes_when_no_source_is_given():
    runner = build_synthetic(SMALL_MOE, dtype="float32")
    bench = VerifyCostBench(runner, None, context_len=5, max_batch_size=2, max_num_tokens=2)
    _, unique = bench.time_forward(2, 2)
    assert len(unique) == 2 and all(2 <= u <= 8 for u in unique)


def test_measure_grid_bookkeeping():
    runner = build_synthetic(SMALL_DENSE, dtype="float32")
    bench = VerifyCostBench(runner, None, context_len=8, max_batch_size=4, max_num_tokens=3)
    calls, order = [], []
    timed = bench.time_forward
    bench.time_forward = lambda b, t: order.append((b, t)) or timed(b, t)
    points = measure_grid(bench, [1, 4], [1, 3], reps=2, on_point=lambda: calls.append(1))
    assert [(p.batch_size, p.num_tokens) for p in points] == [(1, 1), (1, 3), (4, 1), (4, 3)]
    assert len(calls) == 8
    grid = [(1, 1), (1, 3), (4, 1), (4, 3)]
    assert order == [(4, 3)] + grid + grid[::-1]  # warm-up, then every other rep reversed
    for p in points:
        assert len(p.seconds) == 2 and p.min_s <= p.median_s
        assert p.unique_experts == []
        assert set(p.to_json()) == {"B", "T", "seconds", "min_s", "median_s"}


def test_preset_sizes_and_the_cache_rule():
    moe, dense_active = preset_size(PRESETS["moe-128x8"]), preset_size(PRESETS["dense-active"])
    assert abs(moe.active_params - dense_active.active_params) < 0.02 * moe.active_params
    total = preset_size(PRESETS["dense-total"]).total_params
    assert abs(moe.total_params - total) < 0.01 * total
    # The three MoE presets differ in sparsity, not in size.
    sizes = {preset_size(PRESETS[n]).weight_bytes for n in ("moe-128x8", "moe-64x8", "moe-8x2")}
    assert max(sizes) - min(sizes) < 0.01 * max(sizes)
    presets = [PRESETS[n] for n in ("moe-128x8", "dense-active")]
    assert check_preset_sizes(presets, 32 << 20, 2) == []
    warn = check_preset_sizes(presets, 1 << 30, 2)
    assert len(warn) == 2 and "under 4x" in warn[0]
    assert PRESETS["moe-64x8"].scaled(2.0).num_layers == 12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_synthetic_model_runs_the_experts_on_the_backend_a_loaded_model_gets(dtype):
    """The study times presets on the paths served models run: the MoE backend "auto"
    resolves to (the fused kernel in bf16 where the native kernels run) and packed weights,
    and the replayed routing still reaches the experts."""
    from specmoe.layers.moe.backends import MOE_BACKENDS, resolve_moe_backend
    from specmoe.loader.model_loader import DTYPES, _native_bf16
    preset = Preset("small-moe-16", "test", num_experts=8, top_k=2, intermediate_size=32,
                    num_layers=2, hidden_size=256)
    runner = build_synthetic(preset, dtype=dtype)
    cpu = torch.device("cpu")
    name = resolve_moe_backend("auto", cpu, _native_bf16(cpu, DTYPES[dtype]))
    for block in moe_blocks(runner.model):
        assert block.run_experts.__name__ == MOE_BACKENDS[name].__name__
    bench = VerifyCostBench(runner, CorrelatedRouting(8, 2, 0.5), context_len=16,
                            max_batch_size=2, max_num_tokens=3)
    seconds, unique = bench.time_forward(2, 3)
    assert seconds > 0 and len(unique) == 2 and all(1 <= u <= 8 for u in unique)
