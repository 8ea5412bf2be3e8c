"""One-row software prefetch in the bf16 panel kernels (`specmoe.kernels.panel_prefetch`,
`panel_prefetch_tune`): the same bits either way, the setting reaching every loaded kernel
library and later ones, and the tune's choice (environment first, once per process, only on
weights large enough to tell)."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import require_kernel, same_bits

from specmoe.kernels import gemv, moe, panel_prefetch, panel_prefetch_tune
from specmoe.layers.linear import Linear
from specmoe.loader import model_loader
from tiny_models import random_bf16_experts, random_routing


@pytest.fixture(autouse=True)
def fresh_setting(monkeypatch):
    """Each test starts undecided, and leaves the process's setting as it found it."""
    before = panel_prefetch.state()
    monkeypatch.setattr(panel_prefetch, "_state", {"on": False, "source": "default"})
    monkeypatch.delenv(panel_prefetch.ENV, raising=False)
    yield
    for library in panel_prefetch._libraries:
        library.specmoe_set_one_row_prefetch(int(before["on"]))


def _both_ways(fn):
    out = []
    for on in (False, True):
        panel_prefetch.set_enabled(on)
        out.append(fn())
    return out


@pytest.mark.parametrize("n, k", [(576, 1536), (100, 33), (64, 2)])
def test_one_row_linear_has_the_same_bits_with_and_without_prefetch(n, k):
    require_kernel("bf16 linear kernel", gemv.kernel_unavailable_reason())
    torch.manual_seed(0)
    w = torch.randn(n, k).to(torch.bfloat16)
    x, bias = torch.randn(1, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    packed = gemv.pack_weight(w)
    off, on = _both_ways(lambda: gemv.try_linear_bf16(x, w, bias, packed))
    assert same_bits(off, on)
    assert same_bits(on[0], gemv.try_linear_bf16(x.repeat(3, 1), w, bias, packed)[1])


def test_one_row_per_expert_moe_has_the_same_bits_with_and_without_prefetch():
    require_kernel("fused MoE kernel", moe.kernel_unavailable_reason())
    experts = random_bf16_experts(8, 128, 96)
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids, weights = random_routing(3, 8, 2, torch.Generator().manual_seed(1))
    off, on = _both_ways(lambda: moe.try_moe_bf16(
        x, ids, weights, experts.w13, experts.w2, experts.w13_panels, experts.w2_panels))
    assert off is not None and same_bits(off, on)


def test_the_setting_reaches_loaded_libraries_and_later_ones(fma_variant):
    require_kernel("bf16 linear kernel", gemv.kernel_unavailable_reason())
    require_kernel("fused MoE kernel", moe.kernel_unavailable_reason())
    libraries = [gemv._lazy.get().library, moe._lazy.get().library]
    for on in (True, False, True):
        panel_prefetch.set_enabled(on)
        assert [lib.specmoe_one_row_prefetch() for lib in libraries] == [on, on]
    later = fma_variant(gemv.load_kernel).library  # another build, loaded now, gets it
    assert later.specmoe_one_row_prefetch() == 1
    assert panel_prefetch.state()["source"] == "set"


def _weights(nbytes: int) -> list[torch.Tensor]:
    """Packed bf16 panels of about `nbytes`, two matrices and a stack of experts."""
    per = nbytes // 4
    k = 512
    n = max(64, per // (2 * k) // 64 * 64)
    torch.manual_seed(0)
    dense = gemv.pack_weight(torch.randn(n, k).to(torch.bfloat16))
    stacked = gemv.pack_weight(torch.randn(2, n, k).to(torch.bfloat16))
    return [dense, dense.clone(), stacked]


def test_tune_times_both_ways_once_and_keeps_the_faster(monkeypatch):
    require_kernel("bf16 linear kernel", gemv.kernel_unavailable_reason())
    monkeypatch.setattr(panel_prefetch_tune, "MIN_TUNE_BYTES", 1 << 20)
    monkeypatch.setattr(panel_prefetch_tune, "TUNE_PASSES", 2)
    state = panel_prefetch_tune.tune(_weights(4 << 20))
    assert state["source"] == "tuned"
    assert state["on"] == (state["on_s"] < (1 - panel_prefetch_tune.MARGIN) * state["off_s"])
    assert 3 << 20 < state["bytes"] <= 5 << 20
    assert gemv._lazy.get().library.specmoe_one_row_prefetch() == state["on"]
    monkeypatch.setattr(panel_prefetch_tune, "_timed_pass", lambda *a: pytest.fail("retuned"))
    assert panel_prefetch_tune.tune(_weights(4 << 20)) == state  # once per process


def test_tune_reads_at_most_its_budget_of_weights(monkeypatch):
    monkeypatch.setattr(panel_prefetch_tune, "TUNE_BYTES", 1 << 20)
    others = [torch.zeros(4, 4, 64, 2), torch.zeros(8, 64, 2, dtype=torch.bfloat16)]
    calls = panel_prefetch_tune._calls(others + _weights(8 << 20))  # not panels: skipped
    nbytes = sum(w.nbytes for w, _ in calls)
    assert 1 << 20 <= nbytes < (1 << 20) + 2 * calls[0][0].nbytes
    for w, x in calls:  # one matrix each, with its input row
        assert w.dim() == 4 and x.shape == (1, 2 * w.shape[1])


def test_tune_leaves_small_models_undecided(monkeypatch):
    monkeypatch.setattr(panel_prefetch_tune, "_timed_pass", lambda *a: pytest.fail("timed"))
    state = panel_prefetch_tune.tune(_weights(1 << 20))
    assert state == {"on": False, "source": "default"}


@pytest.mark.parametrize("value, on", [("1", True), ("0", False)])
def test_the_environment_decides_without_timing(monkeypatch, value, on):
    monkeypatch.setenv(panel_prefetch.ENV, value)
    monkeypatch.setattr(panel_prefetch_tune, "MIN_TUNE_BYTES", 1 << 10)
    monkeypatch.setattr(panel_prefetch_tune, "_timed_pass", lambda *a: pytest.fail("timed"))
    state = panel_prefetch_tune.tune(_weights(1 << 20))
    assert state == {"on": on, "source": "env"}


def test_a_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv(panel_prefetch.ENV, "yes")
    with pytest.raises(ValueError, match="SPECMOE_ONE_ROW_PREFETCH must be 0 or 1, got 'yes'"):
        panel_prefetch_tune.tune([])


def test_preparing_a_model_tunes_on_its_packed_weights(monkeypatch):
    require_kernel("bf16 linear kernel", gemv.kernel_unavailable_reason())
    seen = []
    monkeypatch.setattr(panel_prefetch_tune, "tune", seen.append)
    model = torch.nn.Sequential(Linear(128, 256), Linear(256, 64)).to(torch.bfloat16)
    model_loader.prepare_for_inference(model, torch.device("cpu"), torch.bfloat16)
    assert [[tuple(t.shape) for t in packed] for packed in seen] == [
        [gemv.packed_shape(256, 128), gemv.packed_shape(64, 256)]]
