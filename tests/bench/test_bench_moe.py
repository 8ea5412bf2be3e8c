"""`specmoe bench moe`: the smoke run end to end through the command line, the unique-expert
and bytes accounting on hand-made routings, and the backends computing the same layer on the
bench's inputs (so the bench compares equal work). No timed assertions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specmoe.analysis.presets import PRESETS as STUDY_PRESETS
from specmoe.bench.moe import MoEBenchConfig, build_layer, prepare_backends
from specmoe.bench.moe_accounting import (backend_stats, expert_bytes, layer_active_params,
                                         layer_bytes, layer_fixed_bytes, model_bytes,
                                         target_of, unique_experts)
from specmoe.bench.moe_report import PNG
from specmoe.bench.roofline import weight_bytes_per_token
from specmoe.config import ArchConfig, MoEConfig
from specmoe.entrypoints.cli import main
from specmoe.layers.moe.backends import set_moe_backend
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.moe.stats import ExpertStatsRecorder
from specmoe.models.decoder import DecoderModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The study's MoE presets: name -> (N, k).
PRESETS = {n: (p.num_experts, p.top_k) for n, p in STUDY_PRESETS.items() if p.is_moe}
NUM_TOKENS = [1, 9, 80]


def _arch(num_experts=8, top_k=2, width=4, hidden=8, shared=0, moe_layers=(0, 1),
          num_layers=2) -> ArchConfig:
    moe = MoEConfig(num_experts=num_experts, top_k=top_k, moe_intermediate_size=width,
                    norm_topk_prob=True, shared_expert_intermediate_size=shared,
                    has_shared_expert_gate=bool(shared), moe_layers=list(moe_layers))
    return ArchConfig(architecture="SyntheticMoE", vocab_size=32, hidden_size=hidden,
                      intermediate_size=12, num_hidden_layers=num_layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, moe=moe)


# ---------------------------------------------------------------- the smoke run


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bench-moe")
    rc = main(["bench", "moe", "--smoke", "--num-tokens", ",".join(map(str, NUM_TOKENS)),
               "--repeats", "2", "--backends", "grouped,grouped_mm", "--out", str(out)])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_smoke_run_writes_json_markdown_and_png(smoke):
    out, results = smoke
    assert (out / PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    for name in PRESETS:
        assert f"## {name}" in report
    assert report.count("### one MoE layer") == report.count("### whole-model step") \
        == len(PRESETS)
    assert "PASS" in report or "FAIL" in report
    env = results["environment"]
    assert len(env["read_bandwidth_probes"]) == 3 * len(PRESETS)  # before, between, after
    assert env["peak_flops"] > 0 and len(env["peak_probes"]) == 1 + len(PRESETS)
    assert results["config"]["baseline"] == "grouped"
    assert results["config"]["overlap"] == pytest.approx(0.381)
    # a smoke run says it measured nothing, and the report speaks of the project only
    assert "Targets not evaluated" in report and "targets met" not in report
    assert "issue" not in report.lower()


def test_smoke_points_are_sane(smoke):
    _, results = smoke
    assert [p["name"] for p in results["presets"]] == list(PRESETS)
    for preset in results["presets"]:
        n, k = PRESETS[preset["name"]]
        assert (preset["shape"]["num_experts"], preset["shape"]["top_k"]) == (n, k)
        assert set(preset["parts"]) == {"layer", "model"}
        for part_name, part in preset["parts"].items():
            assert part["read_bandwidth"] > 0
            assert [p["T"] for p in part["points"]] == NUM_TOKENS
            for p in part["points"]:
                t = p["T"]
                per_rep = p["unique_experts_per_rep"]
                assert len(per_rep) == 2
                assert all(k <= u <= min(n, t * k) for layer in per_rep for u in layer)
                assert k <= p["unique_experts"] <= min(n, t * k)
                # the bytes are the unique experts' bytes plus a fixed part
                for u, b, eb in zip(per_rep, p["bytes_per_rep"], p["expert_bytes_per_rep"]):
                    assert eb == sum(u) * part["expert_bytes"]
                    if part_name == "layer":
                        assert b == part["fixed_bytes"] + eb
                    assert b > eb
                assert p["flops"] == 2.0 * part["active_params_per_token"] * t
                assert p["floor_s"] == max(p["bandwidth_floor_s"], p["compute_floor_s"]) > 0
                assert set(p["backends"]) == {"grouped", "grouped_mm"}
                for name, s in p["backends"].items():
                    assert len(s["seconds"]) == 2 and s["min_s"] > 0
                    assert s["gb_s"] > 0 and s["gf_s"] > 0 and s["time_over_floor"] > 0
                    ratio = s["speedup_vs_baseline"]
                    assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
                    if name == "grouped":
                        assert ratio["median"] == 1.0
                    target = s["target"]
                    assert (target is None) == (9 < t < 80)
                    if target is not None:
                        assert target["passed"] == (target["value"] >= target["required"])
                diffs = p["relative_difference_vs_baseline"]
                assert diffs["grouped"] == 0.0
                assert diffs["grouped_mm"] < (0.05 if part_name == "layer" else 0.2)


def test_cli_refuses_a_dense_preset_and_an_unknown_backend(capsys, tmp_path):
    assert main(["bench", "moe", "--smoke", "--presets", "dense-total",
                 "--out", str(tmp_path)]) == 2
    assert "dense-total" in capsys.readouterr().err
    with pytest.raises(ValueError, match="fused_triton"):
        MoEBenchConfig(backends=["grouped", "fused_triton"])
    with pytest.raises(ValueError, match="num_tokens"):
        MoEBenchConfig(num_tokens=[9, 1])


# ---------------------------------------------------------------- accounting


def test_unique_experts_and_layer_bytes_on_a_hand_made_routing():
    ids = np.array([[0, 1], [1, 2], [2, 0], [5, 1]])
    assert unique_experts(ids) == 4
    assert unique_experts(torch.from_numpy(ids[:2])) == 3
    h, width, n = 8, 16, 8  # a width the experts store unpadded (a multiple of 16)
    block = build_layer(_arch(n, 2, width, h), torch.float32, torch.device("cpu"), seed=0)
    per_expert = 3 * h * width * 4                      # gate, up, down in float32
    assert expert_bytes(block) == per_expert
    assert layer_fixed_bytes(block) == h * n * 4        # the router only
    assert layer_bytes(block, 4) == h * n * 4 + 4 * per_expert
    assert layer_active_params(h, _arch(n, 2, width, h).moe) == h * n + 2 * 3 * h * width


def test_layer_bytes_count_the_shared_expert_and_its_gate():
    arch = _arch(8, 2, 4, 8, shared=6)
    block = build_layer(arch, torch.float32, torch.device("cpu"), seed=0)
    shared = 3 * 8 * 6 + 8                              # the shared expert and its gate
    assert layer_fixed_bytes(block) == (8 * 8 + shared) * 4
    assert layer_active_params(8, arch.moe) == 8 * 8 + shared + 2 * 3 * 8 * 4


def test_model_bytes_on_a_hand_made_routing():
    """A dense layer 0 and two MoE layers; routed experts counted only where touched."""
    arch = _arch(8, 2, 16, 8, shared=6, moe_layers=(1, 2), num_layers=3)
    model = DecoderModel(arch, 64)
    per_expert = 3 * 8 * 16 * 4
    experts, other = model_bytes(model, arch, [2, 5], num_distinct_tokens=3, context_len=10,
                                 num_tokens=4, dtype_bytes=4)
    assert experts == (2 + 5) * per_expert
    embedding = 32 * 8 * 4
    every_weight = sum(p.numel() * 4 for p in model.parameters())
    kv = 3 * (10 + 4) * 2 * 1 * 4 * 4                   # layers x positions x (K, V) x heads x dim
    assert weight_bytes_per_token(model) == every_weight - embedding
    assert other == every_weight - embedding - 2 * 8 * per_expert + 3 * 8 * 4 + kv
    with pytest.raises(ValueError, match="2 MoE layers"):
        model_bytes(model, arch, [2], 3, 10, 4, 4)


def test_backend_stats_and_targets():
    # two repetitions; the second moved twice the bytes in the same time
    s = backend_stats([2.0, 1.0], [10e9, 20e9], flops=4e9, bandwidth=25e9, peak=2e9,
                      num_tokens=1, baseline_seconds=[4.0, 1.0])
    assert s["min_s"] == 1.0 and s["median_s"] == 1.5
    assert s["gb_s"] == pytest.approx(20.0) and s["bandwidth_fraction"] == pytest.approx(0.8)
    assert s["gf_s"] == pytest.approx(4.0) and s["peak_fraction"] == pytest.approx(2.0)
    # floors: max(0.4, 2.0) = 2.0 s and max(0.8, 2.0) = 2.0 s
    assert s["time_over_floor"] == pytest.approx(0.5)
    assert s["speedup_vs_baseline"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    t = s["target"]
    assert (t["kind"], t["required"], t["passed"]) == ("bandwidth", 0.85, False)
    assert t["value"] == pytest.approx(0.8)
    assert target_of(9, 0.86, 0.1)["passed"] and not target_of(1, 0.84, 1.0)["passed"]
    assert target_of(16, 1.0, 1.0) is None and target_of(40, 1.0, 1.0) is None
    assert target_of(80, 0.1, 0.8)["kind"] == "floor" and target_of(320, 0.1, 0.8)["passed"]
    assert not target_of(320, 1.0, 0.79)["passed"]


# ---------------------------------------------------------------- equal work


@pytest.mark.parametrize("num_tokens", [1, 9, 80])
def test_backends_agree_on_the_bench_layer_input(num_tokens):
    """The bench's layer (bf16, both backends prepared side by side, routing forced) gives
    the same output under the loop and grouped_mm backends, and routes as forced."""
    arch = _arch(num_experts=64, top_k=8, width=48, hidden=128)
    block = build_layer(arch, torch.bfloat16, torch.device("cpu"), seed=0)
    prepare_backends(block, ["grouped", "grouped_mm"], torch.device("cpu"))
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 128, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(64, generator=gen)[:8] for _ in range(num_tokens)])
    block.router.next_ids = ids
    block.stats = ExpertStatsRecorder()
    outs = {}
    with torch.inference_mode():
        for name in ("grouped", "grouped_mm", "reference"):
            set_moe_backend(block, name)
            outs[name] = block(x).float()
    assert torch.equal(block.stats.routing[0][0], ids)
    scale = outs["reference"].abs().max().item()
    # bf16 rounds the hidden activations and the output (8 bits each)
    for name in ("grouped", "grouped_mm"):
        torch.testing.assert_close(outs[name], outs["reference"], atol=0.02 * scale, rtol=0.02)
    assert isinstance(block, SparseMoEBlock)
