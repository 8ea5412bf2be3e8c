"""DeepSeek-style routing options (issue 24 item 2): sigmoid scoring, group-limited top-k,
the score-correction bias and the routed scaling factor, against straight transcriptions of
DeepSeek-V2's and V3's published gate code (random fp32 logits: no ties, so torch.topk's
order is irrelevant), plus the tie rule for groups and the config checks."""

from __future__ import annotations

import pytest
import torch

from specmoe.config import MoEConfig
from specmoe.layers.moe.router import TopKRouter

H, N = 24, 16


def _router(**kw) -> TopKRouter:
    torch.manual_seed(1)
    cfg = dict(num_experts=N, top_k=4, moe_intermediate_size=32, norm_topk_prob=False)
    cfg.update(kw)
    router = TopKRouter.from_config(H, MoEConfig(**cfg))
    with torch.no_grad():
        router.gate.weight.normal_(std=0.5)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.normal_(std=0.1)
    return router


def _v3_gate(logits, bias, n_group, topk_group, top_k, norm, scale):
    """DeepSeek-V3's MoEGate.forward (noaux_tc), masked fill as published (0.0)."""
    scores = logits.sigmoid()
    choice = scores + bias.unsqueeze(0)
    t = logits.shape[0]
    group_scores = choice.view(t, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, n_group, N // n_group).reshape(t, -1)
    tmp = choice.masked_fill(~score_mask.bool(), 0.0)
    _, idx = torch.topk(tmp, k=top_k, dim=-1, sorted=False)
    weight = scores.gather(1, idx)
    if norm:
        weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, weight * scale


def _v2_gate(logits, n_group, topk_group, top_k, scale):
    """DeepSeek-V2's MoEGate.forward (group_limited_greedy, norm_topk_prob off)."""
    scores = logits.softmax(dim=-1)
    t = logits.shape[0]
    group_scores = scores.view(t, n_group, -1).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, n_group, N // n_group).reshape(t, -1)
    tmp = scores.masked_fill(~score_mask.bool(), 0.0)
    weight, idx = torch.topk(tmp, k=top_k, dim=-1, sorted=False)
    return idx, weight * scale


def _same_routing(routing, idx, weight):
    """Equal as sets per row (the published code leaves the order to topk), weights too."""
    order = idx.argsort(dim=-1)
    ours = routing.topk_ids.argsort(dim=-1)
    assert torch.equal(routing.topk_ids.gather(1, ours), idx.gather(1, order))
    torch.testing.assert_close(routing.topk_weights.gather(1, ours), weight.gather(1, order))


@pytest.mark.parametrize("norm", [False, True])
def test_noaux_tc_matches_deepseek_v3(norm):
    router = _router(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                     norm_topk_prob=norm, routed_scaling_factor=2.5)
    x = torch.randn(64, H)
    routing = router(x)
    logits = router.gate(x)
    _same_routing(routing, *_v3_gate(logits, router.e_score_correction_bias, 4, 2, 4, norm,
                                     2.5))
    # every kept expert lies in at most 2 groups of 4
    groups = routing.topk_ids // (N // 4)
    assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_group_limited_greedy_matches_deepseek_v2():
    router = _router(topk_method="group_limited_greedy", n_group=8, topk_group=3,
                     routed_scaling_factor=16.0)
    x = torch.randn(64, H)
    routing = router(x)
    _same_routing(routing, *_v2_gate(router.gate(x), 8, 3, 4, 16.0))


def test_sigmoid_greedy_weights_are_the_chosen_scores():
    router = _router(scoring_func="sigmoid", norm_topk_prob=True)
    x = torch.randn(32, H)
    routing = router(x)
    scores = router.gate(x).sigmoid()
    top = scores.topk(4, dim=-1)
    _same_routing(routing, top.indices, top.values / top.values.sum(-1, keepdim=True))


def test_grouped_routing_breaks_group_ties_toward_the_lower_group():
    """All scores equal: groups 0 and 1 are kept (then experts 0..3 by the id rule), whatever
    topk would pick."""
    router = _router(topk_method="group_limited_greedy", n_group=4, topk_group=2)
    routing = router.route_reference(torch.zeros(3, N), torch.float32)
    assert routing.topk_ids.tolist() == [[0, 1, 2, 3]] * 3
    routing = router.route_reference(torch.zeros(1, N).index_fill(1, torch.tensor([13]), 1.0),
                                     torch.float32)
    assert routing.topk_ids.tolist() == [[13, 0, 1, 2]]


def test_masked_experts_never_win_over_negative_corrected_scores():
    """With a strongly negative correction bias every corrected score is negative; the
    experts outside the kept groups must still never be chosen (-inf, not 0, masks them)."""
    router = _router(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=1)
    with torch.no_grad():
        router.e_score_correction_bias.fill_(-5.0)
    routing = router(torch.randn(32, H))
    groups = routing.topk_ids // (N // 4)
    assert all(len(set(row)) == 1 for row in groups.tolist())


def test_only_plain_softmax_runs_the_native_router():
    assert _router().is_softmax_topk
    assert not _router(scoring_func="sigmoid").is_softmax_topk
    assert not _router(routed_scaling_factor=2.0).is_softmax_topk
    assert not _router(topk_method="group_limited_greedy", n_group=4, topk_group=2
                       ).is_softmax_topk


@pytest.mark.parametrize("kw,names", [
    (dict(scoring_func="softplus"), "scoring_func='softplus'"),
    (dict(topk_method="aux"), "topk_method='aux'"),
    (dict(topk_method="noaux_tc", n_group=3, topk_group=1), "n_group=3"),
    (dict(topk_method="noaux_tc", n_group=4, topk_group=5), "topk_group=5"),
    (dict(topk_method="noaux_tc", n_group=8, topk_group=1, top_k=4), "top_k=4"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0"),
])
def test_config_names_the_bad_value(kw, names):
    cfg = dict(num_experts=N, top_k=2, moe_intermediate_size=32, norm_topk_prob=False)
    cfg.update(kw)
    with pytest.raises(ValueError, match=names.replace("(", r"\(")):
        MoEConfig(**cfg)


def test_fused_decoder_driver_leaves_deepseek_routing_to_the_modules():
    from specmoe.layers.moe.block import SparseMoEBlock
    from specmoe.models.fused_moe import plain_moe

    cfg = dict(num_experts=N, top_k=2, moe_intermediate_size=32, norm_topk_prob=False)
    plain = SparseMoEBlock(H, MoEConfig(**cfg), 0)
    plain.run_experts = plain.experts.forward_fused
    sigmoid = SparseMoEBlock(H, MoEConfig(**cfg, scoring_func="sigmoid"), 0)
    sigmoid.run_experts = sigmoid.experts.forward_fused
    assert plain_moe(plain) and not plain_moe(sigmoid)
