"""The end-to-end check on the bundled tiny MoE pair: measured and predicted speedup are
both computed from the same run, and their error is what the report says it is."""

from __future__ import annotations

import pytest

from specmoe.analysis.e2e_check import E2EConfig, run_e2e_check
from specmoe.analysis.speedup import speedup

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]


def test_e2e_check_on_the_tiny_moe_pair():
    cfg = E2EConfig(k=3, batch_sizes=(1, 2), max_tokens=8, reps=1, dtype="float32")
    steps = []
    result = run_e2e_check(cfg, on_step=lambda: steps.append(1))
    assert len(steps) == 2 and [r["B"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert 1.0 <= r["AL"] <= cfg.k + 1
        assert r["measured_speedup"] == pytest.approx(r["plain_s"][0] / r["spec_s"][0])
        expected = speedup(r["AL"], r["Tt_K+1_s"] / r["Tt_1_s"], cfg.k * r["Td_1_s"] / r["Tt_1_s"])
        assert r["predicted_speedup"] == pytest.approx(expected)
        assert r["error"] == pytest.approx(abs(expected - r["measured_speedup"])
                                           / r["measured_speedup"])
    assert result["context_len"] > cfg.max_tokens // 2
