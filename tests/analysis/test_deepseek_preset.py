"""The DeepSeek-V3-shaped study preset (issue 28): its shape beside the other MoE presets,
the DeepSeek model it builds (MLA, grouped sigmoid routing, a shared expert, a dense first
layer) running under the study's replayed routing and its own router, on the latent paged
cache, and the findings that set it against the other presets by k/N."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specmoe.analysis import cost_model as cm
from specmoe.analysis.presets import (EXPERT_WIDTH, PRESETS, TARGET_PRESETS, Preset,
                                      check_preset_sizes, preset_size)
from specmoe.analysis.routing_gen import CorrelatedRouting, TraceRouting
from specmoe.analysis.study import routing_source
from specmoe.analysis.study_config import StudyConfig
from specmoe.analysis.study_findings import _sparsity_lines, shape_extras, sparsity
from specmoe.analysis.study_report import preset_table
from specmoe.analysis.verify_cost import VerifyCostBench, build_synthetic
from specmoe.config import MLAConfig
from specmoe.layers.mla import MLAttention
from specmoe.layers.mlp import GatedMLP
from specmoe.layers.moe.backends import expert_stats, moe_blocks
from specmoe.layers.moe.stats import ExpertStatsRecorder
from specmoe.models.registry import family_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEEPSEEK = PRESETS["deepseek-256x8"]
# The preset's N, k, groups and layout at tiny widths: H=128 (one head), experts of 16.
TINY = dataclasses.replace(DEEPSEEK, hidden_size=128, intermediate_size=16, num_layers=3,
                           mla=MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                         qk_rope_head_dim=8, v_head_dim=8))
OTHER_MOE = ["moe-128x8", "moe-64x8", "moe-8x2"]


def test_the_preset_is_deepseek_v3_shaped_and_in_the_default_grid():
    a = DEEPSEEK.arch()
    assert family_for({"architectures": [a.architecture]}).__name__ == "specmoe.models.deepseek"
    m = a.moe
    assert (m.num_experts, m.top_k, m.moe_intermediate_size) == (256, 8, 192)
    assert (m.scoring_func, m.topk_method, m.n_group, m.topk_group) == ("sigmoid", "noaux_tc",
                                                                        8, 4)
    assert m.shared_expert_intermediate_size == 192 and m.moe_layers == list(range(1, 7))
    assert a.mla is not None and a.num_key_value_heads == a.num_attention_heads == 16
    assert a.intermediate_size == (8 + 1) * 192  # the dense first layer: V3's (k + 1) experts
    assert sparsity(dataclasses.asdict(DEEPSEEK)) == pytest.approx(0.03125)
    assert "deepseek-256x8" in TARGET_PRESETS and "deepseek-256x8" in StudyConfig().presets
    StudyConfig(presets=["deepseek-256x8"], batch_sizes=[1, 2, 4, 8], num_tokens=[1, 2])
    # as many MoE layers and routed-expert weights per MoE layer as the other MoE presets
    for name in OTHER_MOE:
        other = PRESETS[name]
        assert other.num_moe_layers == DEEPSEEK.num_moe_layers == 6
        assert other.num_experts * other.intermediate_size == EXPERT_WIDTH
    assert DEEPSEEK.num_experts * DEEPSEEK.intermediate_size == EXPERT_WIDTH


def test_the_cache_rule_holds_at_least_as_well_as_for_the_other_moe_presets():
    size = preset_size(DEEPSEEK).weight_bytes
    others = [preset_size(PRESETS[n]).weight_bytes for n in OTHER_MOE]
    assert max(others) <= size < 1.05 * max(others)
    llc = 480 << 20  # this machine's
    assert check_preset_sizes([DEEPSEEK], llc, 2) == []
    # at a cache between the others' size / 4 and its own it is the one not warned about
    warned = check_preset_sizes([DEEPSEEK, *(PRESETS[n] for n in OTHER_MOE)],
                                (size + max(others)) // 8, 2)
    assert len(warned) == 3 and not any("deepseek" in w for w in warned)


def test_scaling_keeps_the_dense_first_layer():
    assert DEEPSEEK.scaled(0.2).num_layers == 2  # the dense layer and one MoE layer
    assert DEEPSEEK.scaled(0.5).num_moe_layers == 3
    assert DEEPSEEK.scaled(2.0).num_layers == 13
    with pytest.raises(ValueError, match="leaves no MoE layer"):
        dataclasses.replace(DEEPSEEK, num_layers=1)
    with pytest.raises(ValueError, match="grouped routing"):
        Preset("x", "x", 16, 2, 32, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="options of an MoE preset"):
        Preset("x", "x", 0, 0, 32, shared_experts=1)


def test_the_preset_survives_results_json():
    """The study reads presets back from results.json (`Preset(**asdict)`) for the fit."""
    back = Preset(**dataclasses.asdict(DEEPSEEK))
    assert back == DEEPSEEK and back.arch() == DEEPSEEK.arch()


def test_tiny_model_has_the_layout_and_the_counted_size():
    runner = build_synthetic(TINY, dtype="float32")
    model = runner.model
    assert sum(p.numel() for p in model.parameters()) == preset_size(TINY).total_params
    assert isinstance(model.layers[0].mlp, GatedMLP)
    assert model.layers[0].mlp.gate_up_proj.weight.shape[0] == 2 * (8 + 1) * 16
    blocks = moe_blocks(model)
    assert [b.layer_idx for b in blocks] == [1, 2]
    assert all(b.shared_expert is not None for b in blocks)
    assert all(isinstance(layer.attn, MLAttention) for layer in model.layers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_study_routing_reaches_the_experts_of_every_moe_layer(dtype):
    cfg = StudyConfig(presets=["deepseek-256x8"], batch_sizes=[1, 2, 4, 8], num_tokens=[1, 2, 4])
    source = routing_source(TINY, cfg)
    assert isinstance(source, CorrelatedRouting) and source.num_experts == 256
    runner = build_synthetic(TINY, dtype=dtype)
    recorder = ExpertStatsRecorder()
    bench = VerifyCostBench(runner, source, context_len=20, max_batch_size=3, max_num_tokens=4)
    expert_stats(runner.model).subscribe(recorder)
    seconds, unique = bench.time_forward(3, 4)
    assert seconds > 0 and len(unique) == 2  # the MoE layers, not the dense one
    for block, u in zip(moe_blocks(runner.model), unique):
        given = block.router.next_ids
        assert given.shape == (12, 8)
        assert torch.equal(recorder.routing[block.layer_idx][-1], given)
        assert recorder.unique_experts[block.layer_idx][-1] == u
    assert all(torch.isfinite(c).all() for layer in bench.cache.layers for c in layer)


def test_own_grouped_router_and_a_prefilled_latent_cache():
    """The model's own sigmoid grouped router (routing "router") and real-text windows
    prefilled into the latent cache (the path a real model is timed on)."""
    runner = build_synthetic(TINY, dtype="float32")
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, runner.vocab_size, size=14).tolist() for _ in range(2)]
    bench = VerifyCostBench(runner, None, context_len=10, max_batch_size=2, max_num_tokens=3,
                            token_windows=windows)
    latent = bench.cache.layers[0][0]
    assert latent.shape[-1] == 16 + 8 and latent.abs().sum() > 0  # prefilled
    _, unique = bench.time_forward(2, 3)
    assert len(unique) == 2 and all(8 <= u <= min(256, 2 * 3 * 8) for u in unique)


def test_trace_routing_gives_one_source_per_moe_layer(monkeypatch):
    from specmoe.analysis import study
    base = TraceRouting([np.zeros((6, 5, 8), np.int64)], 256)
    monkeypatch.setattr(study.TraceRouting, "from_trace", staticmethod(lambda trace: base))
    cfg = StudyConfig(presets=["deepseek-256x8"], batch_sizes=[1, 2, 4, 8], num_tokens=[1, 2],
                      routing="trace", routing_trace="t.jsonl", routing_model=None)
    sources = routing_source(DEEPSEEK, cfg, trace=None)
    assert len(sources) == DEEPSEEK.num_moe_layers == 6
    assert [s.layer for s in sources] == list(range(6))


def test_cost_model_shape_counts_the_dense_layer_shared_expert_and_latent():
    s = cm.ShapeCounts.from_preset(DEEPSEEK)
    a = DEEPSEEK.arch()
    assert (s.num_dense_layers, s.num_moe_layers) == (1, 6)
    assert s.mlp_params == 3 * 2048 * 192 and s.dense_mlp_params == 3 * 2048 * 1728
    assert s.attn_params == a.attention_params < PRESETS["moe-128x8"].arch().attention_params
    assert s.kv_bytes_per_token == (512 + 64) * 2
    machine = cm.MachineProfile(1e9, 1e9, [1, 2], [1e-9, 2e-9])
    f = cm.features(s, machine, batch_size=1, num_tokens=1, context_len=0, unique_experts=8)
    assert f[cm.FEATURES.index("expert_call")] == 6 * 8  # expert calls: the MoE layers only
    no_dense = dataclasses.replace(s, num_dense_layers=0, dense_mlp_params=0)
    g = cm.features(no_dense, machine, batch_size=1, num_tokens=1, context_len=0,
                    unique_experts=8)
    # one MoE layer less, one dense MLP more (rows=1: 1e-9 s per byte, 2 bytes per weight)
    moe_layer = (s.mlp_params + s.router_params + 8 * s.expert_params) * 2e-9
    assert f[0] + f[1] - g[0] - g[1] == pytest.approx(s.dense_mlp_params * 2e-9 - moe_layer)


def _points(ratios: dict[int, float]) -> list[dict]:
    """Tt(B, 1) = 1 s and Tt(B, 2) = ratio at every B."""
    return [p for b, r in ratios.items() for p in ({"B": b, "T": 1, "min_s": 1.0},
                                                    {"B": b, "T": 2, "min_s": r})]


def _presets(rise: dict[str, tuple[float, float]]) -> dict:
    return {n: {"preset": dataclasses.asdict(PRESETS[n]), "points": _points({1: lo, 8: hi})}
            for n, (lo, hi) in rise.items()}


def test_findings_answer_whether_the_smallest_k_over_n_verifies_flattest():
    flat = _presets({"moe-8x2": (1.1, 2.2), "moe-128x8": (1.1, 1.65),
                     "deepseek-256x8": (1.1, 1.32)})
    [line] = _sparsity_lines(flat, list(flat))
    assert line.index("deepseek-256x8 (k/N 3.1%) 1.32x, +20%") < line.index("moe-128x8 (k/N 6.2%)")
    assert "the sparsest, deepseek-256x8, keeps verification flattest" in line
    assert "grows with k/N across all of them" in line
    assert "deepseek-256x8 has MLA attention, 1 shared expert, 1 dense first layer" in line
    steep = _presets({"moe-128x8": (1.1, 1.32), "deepseek-256x8": (1.1, 1.65)})
    [line] = _sparsity_lines(steep, list(steep))
    assert "does not keep verification flattest (moe-128x8 rises least)" in line
    assert "does not grow steadily" in line
    assert _sparsity_lines(_presets({"moe-128x8": (1.1, 1.3)}), ["moe-128x8"]) == []


def test_report_table_shows_k_over_n_and_the_deepseek_layout():
    presets = _presets({"moe-128x8": (1.0, 1.0), "deepseek-256x8": (1.0, 1.0)})
    for n in presets:
        presets[n]["size"] = dataclasses.asdict(preset_size(PRESETS[n]))
    text = "\n".join(preset_table(presets, 480 << 20))
    assert "N=256, k=8 (k/N 3.1%), expert width 192, MLA attention, 1 shared expert" in text
    assert "N=128, k=8 (k/N 6.2%), expert width 384 |" in text
    assert shape_extras({"num_experts": 8, "top_k": 2}) == []  # an older results.json
