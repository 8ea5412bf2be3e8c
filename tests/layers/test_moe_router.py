"""Top-k routing ties (issue 23 D14): among equal weights the lower expert id wins, whatever
the backend's topk would pick, so routing and outputs do not depend on the device."""

from __future__ import annotations

import pytest
import torch

from specmoe.layers.moe.router import TopKRouter, select_experts

N = 32


def _row(tied: list[int], value: float = 5.0, others: float = 0.0) -> torch.Tensor:
    row = torch.full((N,), others)
    row[tied] = value
    return row


@pytest.mark.parametrize("logits,k,expected", [
    # the cases of the issue: five tied for four slots, a boundary tie, all equal
    (_row([3, 7, 11, 20, 25]), 4, [3, 7, 11, 20]),
    (_row([4, 9, 30], value=1.0) + _row([1, 2, 3], value=2.0), 4, [1, 2, 3, 4]),
    (torch.zeros(N), 4, [0, 1, 2, 3]),
    # heavier first, ties in id order inside the kept set
    (_row([17, 5], value=3.0) + _row([9], value=4.0), 3, [9, 5, 17]),
], ids=["five-for-four", "boundary", "all-equal", "order"])
def test_ties_go_to_the_lower_expert_id(logits, k, expected):
    probs = torch.softmax(logits.unsqueeze(0), dim=-1)
    weights, ids = select_experts(probs, k)
    assert ids.tolist() == [expected]
    assert torch.equal(weights, probs[:, expected])


def test_router_applies_the_rule_on_bfloat16_ties():
    """Router rows whose bf16 gate outputs tie exactly, many at the top-k boundary: the kept
    ids are those a (weight descending, id ascending) order gives, on every row. The gate is
    the identity, so its outputs are the crafted values whatever the matmul's summation order
    (only exact zeros are added)."""
    torch.manual_seed(0)
    router = TopKRouter(hidden_size=N, num_experts=N, top_k=4, norm_topk_prob=True)
    router.to(torch.bfloat16)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(N))
    x = (torch.randint(0, 4, (64, N)) / 4).to(torch.bfloat16)  # 4 levels: ties everywhere
    routing = router(x)
    probs = torch.softmax(x.float(), dim=-1)
    for t in range(x.shape[0]):
        order = sorted(range(N), key=lambda e: (-probs[t, e].item(), e))[:4]
        assert routing.topk_ids[t].tolist() == order
    assert torch.allclose(routing.topk_weights.float().sum(-1), torch.ones(64), atol=1e-2)
