"""The cost model's arithmetic on hand-checked configurations, its fit, and the Amdahl
estimate."""

from __future__ import annotations

import numpy as np
import pytest

from specmoe.analysis import cost_model as cm
from specmoe.analysis.presets import PRESETS

# Probed: 1e-9 s per weight byte at one row, 2e-9 at two; past the last probe the time per
# byte grows in proportion to the rows, so tau(m) = m * 1e-9 for every m >= 1.
MACHINE = cm.MachineProfile(bandwidth=1e9, stream_bandwidth=1e9, probe_rows=[1, 2],
                            seconds_per_byte=[1e-9, 2e-9], dtype_bytes=2)
MOE = cm.ShapeCounts(num_layers=2, attn_params=1000, mlp_params=0, expert_params=500,
                     router_params=40, head_params=2000, kv_bytes_per_token=8, num_experts=4,
                     top_k=2, dtype_bytes=2)
DENSE = cm.ShapeCounts(num_layers=2, attn_params=1000, mlp_params=1500, expert_params=0,
                       router_params=0, head_params=2000, kv_bytes_per_token=8, num_experts=0,
                       top_k=0, dtype_bytes=2)


def test_matmul_seconds_interpolate_then_extrapolate_in_rows():
    assert MACHINE.matmul_seconds(1, 1000) == pytest.approx(2000 * 1e-9)
    assert MACHINE.matmul_seconds(1.5, 1000) == pytest.approx(2000 * 1.5e-9)
    assert MACHINE.matmul_seconds(8, 1000) == pytest.approx(2000 * 8e-9)   # 4x the last
    assert MACHINE.matmul_seconds(0.5, 1000) == pytest.approx(2000 * 1e-9)  # clamped
    assert MACHINE.matmul_seconds(0, 1000) == 0.0
    # flop/s of the probe: 2 m / (s tau(m)) = 1e9 at both probes.
    assert MACHINE.flops == pytest.approx([1e9, 1e9])
    assert set(MACHINE.to_json()) >= {"bandwidth", "seconds_per_byte", "flops"}


def test_moe_features_by_hand():
    # B=2, T=1: 2 rows; 3 unique experts, each with 2 * 2 / 3 rows.
    f = cm.features(MOE, MACHINE, batch_size=2, num_tokens=1, context_len=10, unique_experts=3)
    attn, router = 2 * 1000 * 2e-9, 2 * 40 * 2e-9
    experts = 3 * 2 * 500 * (4 / 3) * 1e-9
    head = 2 * 2000 * 2e-9
    assert f[0] + f[1] == pytest.approx(2 * (attn + router + experts) + head)
    # the memory part streams every weight once at the one-row time per byte (1e-9 s)
    assert f[0] == pytest.approx(2 * 2 * (1000 + 40 + 3 * 500) * 1e-9 + 2 * 2000 * 1e-9)
    assert f[2] == 2 * 2                                         # layers x rows
    assert f[3] == pytest.approx(2 * 2 * (10 + 1) * 8 / 1e9)   # layers x B x positions x bytes
    assert f[4] == 1.0
    assert f[5] == 2 * 3                                         # layers x unique experts
    assert len(f) == len(cm.FEATURES)


def test_dense_features_by_hand():
    # B=4, T=8: 32 rows through every weight.
    f = cm.features(DENSE, MACHINE, 4, 8, context_len=0, unique_experts=0)
    assert f[0] + f[1] == pytest.approx(2 * 2 * (1000 + 1500) * 32e-9 + 2 * 2000 * 32e-9)
    assert f[1] == pytest.approx(31 * f[0])  # 32 rows cost 32x the one-row stream here
    assert f[2] == 2 * 32
    assert f[3] == pytest.approx(2 * 4 * 8 * 8 / 1e9)
    assert f[5] == 0.0


def test_fit_recovers_known_nonnegative_coefficients():
    rng = np.random.default_rng(0)
    feats = np.column_stack([rng.uniform(0.01, 0.1, 20), rng.uniform(0, 0.1, 20),
                             rng.uniform(0, 500, 20), rng.uniform(0, 0.01, 20), np.ones(20),
                             rng.uniform(0, 500, 20)])
    truth = np.array([0.7, 1.1, 3e-5, 2.0, 0.004, 2e-5])
    model = cm.CostModel.fit(feats, feats @ truth)
    assert np.allclose(model.coefficients, truth, rtol=1e-6)
    assert np.allclose(model.predict(feats), feats @ truth)
    assert set(model.to_json()) == set(cm.FEATURES)


def test_fit_keeps_coefficients_nonnegative_and_needs_enough_points():
    feats = np.column_stack([np.linspace(1, 2, 8)] + [np.ones(8)] * 5)
    model = cm.CostModel.fit(feats, np.linspace(1, 2, 8) * 0.5 - 0.1)
    assert min(model.coefficients) >= 0.0
    with pytest.raises(ValueError, match="6 coefficients to 3 points"):
        cm.CostModel.fit(feats[:3], np.ones(3))


def test_amdahl_estimate_by_hand():
    # Experts' share of bytes at (B=1, T=1) with U=2: 2 layers x 2 x 500 weights.
    expert = 2 * 2 * 500 * 2
    rest = (2 * (1000 + 40) + 2000) * 2 + 2 * 1 * (10 + 1) * 8
    f = expert / (expert + rest)
    got = cm.amdahl_estimate(MOE, t_one=0.01, unique_one=2, unique_t=3, batch_size=1,
                             context_len=10)
    assert got == pytest.approx(0.01 * ((1 - f) + f * 1.5))
    assert cm.amdahl_estimate(DENSE, 0.01, 1, 1, 1, 10) == 0.01


def test_shape_counts_of_a_preset():
    p = PRESETS["moe-8x2"]
    s = cm.ShapeCounts.from_preset(p)
    a = p.arch()
    assert s.expert_params == 3 * a.hidden_size * p.intermediate_size
    assert s.router_params == a.hidden_size * 8 and s.mlp_params == 0
    assert s.kv_bytes_per_token == 2 * a.num_key_value_heads * a.head_dim * 2
    assert cm.relative_errors([1.1, 0.9], [1.0, 1.0]) == pytest.approx([0.1, 0.1])


def test_linear_probe_packs_each_piece_once(monkeypatch):
    """The probe times the kernel on packed weights, as a loaded model runs it: repacking a
    piece inside the timed loop measured the packing (3 GB/s where the kernel reads 19)."""
    import torch

    from specmoe.kernels import gemv
    packs = []
    real = gemv.pack_weight
    monkeypatch.setattr(gemv, "pack_weight", lambda w, out=None: packs.append(1) or real(w, out))
    pieces = cm._weight_pieces(2 << 20, torch.bfloat16, "cpu", piece_bytes=1 << 20)
    cm._time_rows(pieces, rows=4, repeats=3)
    assert len(packs) <= len(pieces)  # once per piece (0 where the kernel does not run)


def test_shared_expert_runs_for_every_row_beside_the_routed_ones():
    shared = cm.ShapeCounts(**{**MOE.__dict__, "mlp_params": 300})
    f = cm.features(shared, MACHINE, batch_size=2, num_tokens=1, context_len=10,
                    unique_experts=3)
    base = cm.features(MOE, MACHINE, batch_size=2, num_tokens=1, context_len=10,
                       unique_experts=3)
    # L x (rows at B=2) x bytes
    assert f[0] + f[1] - base[0] - base[1] == pytest.approx(2 * 300 * 2 * 2e-9)
    assert f[2:].tolist() == base[2:].tolist()
    # the Amdahl estimate counts the shared expert among the bytes that do not grow with T
    assert cm.amdahl_estimate(shared, 0.01, 2, 3, 1, 10) < cm.amdahl_estimate(MOE, 0.01, 2, 3,
                                                                              1, 10)


def test_shape_counts_of_a_loaded_architecture():
    from specmoe.config import ArchConfig, MoEConfig
    common = dict(architecture="Qwen2MoeForCausalLM", vocab_size=100, hidden_size=16,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
                  max_position_embeddings=64)
    moe = MoEConfig(num_experts=8, top_k=2, moe_intermediate_size=8, norm_topk_prob=True,
                    shared_expert_intermediate_size=16, moe_layers=[0, 1])
    s = cm.ShapeCounts.from_arch(ArchConfig(**common, moe=moe))
    assert (s.num_experts, s.top_k, s.expert_params) == (8, 2, 3 * 16 * 8)
    assert s.mlp_params == 3 * 16 * 16 + 16 and s.router_params == 16 * 8
    assert s.head_params == 100 * 16 and s.kv_bytes_per_token == 2 * 2 * 4 * 2
    dense = cm.ShapeCounts.from_arch(ArchConfig(**common))
    assert dense.num_experts == 0 and dense.mlp_params == 3 * 16 * 64
    # DeepSeek's dense first layers: layer 0 runs a dense MLP of intermediate_size
    half = cm.ShapeCounts.from_arch(ArchConfig(**common, moe=MoEConfig(
        **{**moe.__dict__, "moe_layers": [1]})))
    assert (half.num_dense_layers, half.num_moe_layers) == (1, 1)
    assert half.dense_mlp_params == 3 * 16 * 64 and s.num_dense_layers == 0


def test_roofline_envelope_caps_a_slow_phase_at_what_fewer_rows_imply():
    rows = [1, 2, 12, 16, 17]
    probed = [1e-10, 1e-10, 5e-10, 17e-10, 5.5e-10]   # 16 rows landed in slow memory
    capped = cm.roofline_envelope(rows, probed)
    assert capped[3] == pytest.approx(5e-10 * 16 / 12)
    assert capped[:3] + capped[4:] == probed[:3] + probed[4:]
    # a physical profile (flat while memory-bound, then linear in rows) is left alone
    physical = [1e-10, 1e-10, 3e-10, 4e-10, 4.25e-10]
    assert cm.roofline_envelope(rows, physical) == physical


def test_probe_interleaves_row_counts_and_keeps_each_minimum(monkeypatch):
    calls, times = [], iter([5.0, 9.0, 4.0, 2.0, 3.0, 7.0])
    monkeypatch.setattr(cm, "_time_rows", lambda pieces, m, repeats: calls.append(m)
                        or next(times))
    assert cm._probe_rows([], [1, 8], repeats=3) == [3.0, 2.0]
    assert calls == [1, 8, 1, 8, 1, 8]


def test_fit_on_two_token_counts_tells_per_row_from_per_request_work():
    """At T = 1 per-row work and KV reads both grow as B; only the T = 2 column separates
    them. Timings with both kinds of work are predicted at T = 8 by the fit on FIT_TOKENS;
    a fit on T = 1 alone explains its own points but puts the work on the wrong term."""
    machine = cm.MachineProfile(1e9, 1e9, [1, 1024], [1e-9, 1e-9])  # memory-bound throughout
    per_row, per_kv = 1e-4, 200.0  # seconds per layer-row; attention cost per KV-read second

    def timing(b, t):
        f = cm.features(DENSE, machine, b, t, context_len=64, unique_experts=0)
        return f[0] + f[1] + per_row * f[2] + per_kv * f[3] + 1e-3

    grid = [(b, t) for b in (1, 2, 4, 8, 16, 32) for t in (1, 2, 8)]
    feats = {p: cm.features(DENSE, machine, *p, context_len=64, unique_experts=0)
             for p in grid}

    def fitted(ts):
        pts = [p for p in grid if p[1] in ts]
        return cm.CostModel.fit(np.stack([feats[p] for p in pts]),
                                np.array([timing(*p) for p in pts]))

    assert cm.FIT_TOKENS == (1, 2)
    model = fitted(cm.FIT_TOKENS)
    assert model.predict(feats[16, 8])[0] == pytest.approx(timing(16, 8), rel=1e-3)
    t_one = fitted((1,))
    assert t_one.predict(feats[16, 1])[0] == pytest.approx(timing(16, 1), rel=1e-3)
    assert abs(t_one.predict(feats[16, 8])[0] / timing(16, 8) - 1) > 0.1
