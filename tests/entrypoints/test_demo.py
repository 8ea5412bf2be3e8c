"""`specmoe demo` on the real default model and the bundled MoE pair: both pairs in one
table, timed runs only, identical greedy outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specmoe.entrypoints.cli import main
from specmoe.entrypoints.demo import DemoRow, pooled_speedup


def _row(num_plain: int, plain_s: float, num_spec: int, spec_s: float) -> DemoRow:
    out = lambda n: SimpleNamespace(token_ids=list(range(n)))  # noqa: E731
    return DemoRow("pair", "qa", {"plain": (out(num_plain), plain_s),
                                  "static": (out(num_spec), spec_s),
                                  "adaptive": (out(num_plain), plain_s)})


def test_pooled_speedup_is_total_tokens_per_second_not_a_mean_of_ratios():
    rows = [_row(100, 10.0, 100, 5.0), _row(10, 1.0, 10, 1.0)]
    assert pooled_speedup(rows, "static") == pytest.approx((110 / 6.0) / (110 / 11.0))
    assert pooled_speedup(rows, "adaptive") == pytest.approx(1.0)


def test_demo_shows_the_dense_and_the_moe_pair(smollm2, capsys):
    assert main(["demo", "--model", smollm2, "--num-prompts", "2", "--max-tokens", "12",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m + n-gram K=4" in out and "tiny-moe + tiny-moe-draft K=4" in out
    assert "dense: smollm2-135m" in out and "MoE: tiny-moe" in out
    assert out.count("pooled") == 2 and out.count("2/2") == 2  # identical outputs, both pairs
    assert "NO" not in out
    # the three modes, and one measured line of why per pair
    assert "adaptive" in out and "static" in out
    for pair in ("why, smollm2-135m: ", "why, tiny-moe: "):
        line = next(ln for ln in out.splitlines() if ln.startswith(pair))
        assert "MB of weights" in line and "drafting took" in line and "adaptive " in line
