"""Top-k routing of tokens to experts: softmax top-k (Shazeer et al. 2017, arXiv 1701.06538;
Mixtral, Jiang et al. 2024, arXiv 2401.04088, eq. 1) and DeepSeek's sigmoid scoring, grouped
top-k and routed scaling (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3, arXiv 2412.19437)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specmoe.kernels.router import try_route_softmax_bf16
from specmoe.layers.linear import Linear

_NORM_EPS = {"softmax": 0.0, "sigmoid": 1e-20}


@dataclass(slots=True)
class RoutingResult:
    """Which experts each token uses and with what weight.

    Attributes:
        topk_ids: [num_tokens, top_k] int64 expert ids, most weighted first.
        topk_weights: [num_tokens, top_k] in the hidden dtype.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def select_experts(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k experts of each row, heaviest first; among equal weights the lower expert
    id wins (and comes first).

    `torch.topk` leaves ties to the backend (on CPU it picked 9 over 4 at a boundary tie, and
    (22, 21, 20, 23) from all-equal weights); bfloat16 router logits tie exactly at the top-k
    boundary in about 1% of rows, so routing, and with it the output, would depend on the
    device. A stable descending sort fixes the rule, the one vLLM's grouped top-k uses.

    Args:
        probs: [T, N] float routing weights.
        top_k: k, 1 <= k <= N.
    Returns:
        (weights [T, k] probs' dtype, ids [T, k] int64).
    """
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    return weights[:, :top_k].contiguous(), ids[:, :top_k].contiguous()


def group_limited_mask(choice: torch.Tensor, n_group: int, topk_group: int,
                       group_score: str) -> torch.Tensor:
    """Scores outside each row's best `topk_group` groups set to -inf (DeepSeek-V2's
    group-limited routing, arXiv 2405.04434 sec. 2.1.2; V3's node-limited routing, arXiv
    2412.19437 sec. 2.1.2). Groups are contiguous runs of N / n_group experts, ranked by
    their maximum (`group_score="max"`, V2) or the sum of their two best (`"top2_sum"`, V3);
    among equal group scores the lower group wins, as `select_experts` rules for experts.
    -inf rather than transformers' 0 so that a masked expert never beats a kept one whose
    corrected score is negative (vLLM's choice too).

    Args:
        choice: [T, N] float32 scores the experts are chosen on.
    Returns:
        [T, N] float32.
    """
    t, n = choice.shape
    grouped = choice.view(t, n_group, n // n_group)
    if group_score == "max":
        score = grouped.max(dim=-1).values
    else:
        score = grouped.topk(min(2, n // n_group), dim=-1).values.sum(dim=-1)
    _, keep = select_experts(score, topk_group)  # [T, topk_group]
    mask = torch.zeros(t, n_group, dtype=torch.bool, device=choice.device)
    mask.scatter_(1, keep, True)
    mask = mask.unsqueeze(-1).expand(t, n_group, n // n_group).reshape(t, n)
    return choice.masked_fill(~mask, float("-inf"))


class TopKRouter(nn.Module):
    """Scores = softmax (or sigmoid) of x @ W_gate^T in float32, keep the top_k experts (ties:
    lower id wins, see `select_experts`), optionally renormalise their weights to sum to 1
    (`norm_topk_prob`; Mixtral always does, Qwen-MoE/OLMoE by config), then scale them by
    `routed_scaling_factor`.

    DeepSeek's options (names as in their configs; `MoEConfig` documents them): sigmoid
    scoring, group-limited top-k (`topk_method` "group_limited_greedy": groups ranked by
    their best score; "noaux_tc": the choice made on score + `e_score_correction_bias`, a
    [N] float32 parameter loaded from the checkpoint, groups ranked by the sum of their two
    best, the weights taken from the uncorrected scores). The native router kernel runs
    plain softmax top-k only (`is_softmax_topk`); the others run `route_reference`. One
    divergence from DeepSeek-V2's code, which skips the scaling when it renormalises: here
    the scale always applies (V3's rule; no released V2 config sets both).

    Args:
        hidden_size: H.
        num_experts: N.
        top_k: k.
        norm_topk_prob: renormalise the kept weights.
        scoring_func, topk_method, n_group, topk_group, routed_scaling_factor: see
            `specmoe.config.MoEConfig` (validated there).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, scoring_func: str = "softmax",
                 topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, num_experts)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.scoring_func = scoring_func
        self.topk_method = topk_method
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        # A parameter (never trained) rather than a buffer: checkpoints carry it, and the
        # weight loader fills, and checks, parameters.
        bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
                            ) if topk_method == "noaux_tc" else None
        self.register_parameter("e_score_correction_bias", bias)

    @classmethod
    def from_config(cls, hidden_size: int, moe) -> "TopKRouter":
        """The router a `MoEConfig` describes."""
        return cls(hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob,
                   moe.scoring_func, moe.topk_method, moe.n_group, moe.topk_group,
                   moe.routed_scaling_factor)

    @property
    def is_softmax_topk(self) -> bool:
        """Plain softmax top-k, unscaled: what the native router kernel (and with it the
        fused decoder driver) computes."""
        return (self.scoring_func == "softmax" and self.topk_method == "greedy"
                and self.routed_scaling_factor == 1.0)

    def forward(self, x: torch.Tensor) -> RoutingResult:
        """x [T, H] -> RoutingResult with [T, top_k] ids and weights. bf16 on CPU with plain
        softmax top-k routes in one native call (`specmoe.kernels.router`, which the fused
        decoder driver calls too); `route_reference` is its plain-torch reference, with the
        same bits where torch runs its AVX-512 kernels."""
        logits = self.gate(x)
        if self.is_softmax_topk and x.dtype is torch.bfloat16:
            routed = try_route_softmax_bf16(logits, self.top_k, self.norm_topk_prob)
            if routed is not None:
                return RoutingResult(*routed)
        return self.route_reference(logits, x.dtype)

    def forward_reference(self, x: torch.Tensor) -> RoutingResult:
        """Plain-torch reference of `forward`."""
        return self.route_reference(self.gate(x), x.dtype)

    def route_reference(self, logits: torch.Tensor, dtype: torch.dtype) -> RoutingResult:
        """The routing of gate outputs `logits` [T, N] in plain torch, weights in `dtype`."""
        logits = logits.float()
        if self.scoring_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)  # [T, N]
        if self.topk_method == "greedy":
            weights, ids = select_experts(scores, self.top_k)
        else:
            choice = scores
            if self.e_score_correction_bias is not None:
                choice = scores + self.e_score_correction_bias.float()
            group_score = "top2_sum" if self.topk_method == "noaux_tc" else "max"
            choice = group_limited_mask(choice, self.n_group, self.topk_group, group_score)
            _, ids = select_experts(choice, self.top_k)
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            # DeepSeek adds 1e-20 against an all-zero sigmoid row; softmax rows never are.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS[self.scoring_func])
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return RoutingResult(ids, weights.to(dtype))
