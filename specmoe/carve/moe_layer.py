"""One carved MoE layer in Qwen2-MoE's math, trainable in float32: softmax router, top-k with
renormalised weights, SwiGLU routed experts, a shared expert scaled by sigmoid(x @ g).

Initialised from the dense FFN so that it starts close to it: expert e is the slice of the
dense FFN's neurons `routed[e]`, the shared expert the slice `shared`. The dense FFN is the
plain sum of its slices, while Qwen2-MoE weights expert e by its renormalised router
probability p_e (k of them summing to 1) and the shared expert by sigmoid(x @ g); so the
routed down projections start multiplied by k and the router's logits small (p_e ~ 1/k), and
the shared gate starts at 0 with the shared down projection doubled (sigmoid(0) = 1/2). With
k = N and a zero router that is exact up to float rounding. The router starts from a ridge
regression of each expert's log output energy on the FFN input (closed form; the "which
experts carry the largest contribution" target), scaled down to `ROUTER_INIT_STD`; the
reconstruction training then adjusts router, experts and shared gate together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROUTER_INIT_STD = 0.1  # std of the initial router logits over experts: near-uniform weights
# (attribute, Qwen2-MoE name) of the shared expert's tensors; none are written without one
_SHARED = (("shared_gate_proj", "shared_expert.gate_proj"), ("shared_up", "shared_expert.up_proj"),
           ("shared_down", "shared_expert.down_proj"), ("shared_gate", "shared_expert_gate"))
RIDGE = 1e-2           # ridge penalty, relative to the mean diagonal of X^T X


def expert_energy(act: torch.Tensor, w_down: torch.Tensor, routed: torch.Tensor
                  ) -> torch.Tensor:
    """||expert e's output||^2 per token: act [T, I], w_down [H, I], routed [N, m] -> [T, N]."""
    return torch.stack([F.linear(act[:, idx], w_down[:, idx]).pow(2).sum(-1)
                        for idx in routed], dim=1)


def fit_router(x: torch.Tensor, energy: torch.Tensor) -> torch.Tensor:
    """Ridge regression of log expert energy (centred per token) on x [T, H]; returns the
    router weight [N, H], rescaled so that its logits have std ROUTER_INIT_STD over experts."""
    target = torch.log(energy + 1e-12 * energy.mean())
    target = target - target.mean(dim=1, keepdim=True)
    xtx = x.T.double() @ x.double()
    penalty = RIDGE * xtx.diagonal().mean()
    eye = torch.eye(x.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(xtx + penalty * eye, x.T.double() @ target.double()).T.float()
    std = float((x @ w.T).std(dim=1).mean())
    return w * (ROUTER_INIT_STD / std) if std > 0 else w


class CarvedMoE(nn.Module):
    """Router [N, H], routed experts gate/up [N, m, H] and down [N, H, m], shared expert
    gate/up [s, H] and down [H, s] (s = 0: none), shared gate [1, H]; float32."""

    def __init__(self, w: dict[str, torch.Tensor], shared: torch.Tensor,
                 routed: torch.Tensor, top_k: int, router: torch.Tensor) -> None:
        super().__init__()
        gate, up, down = w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], \
            w["mlp.down_proj.weight"]
        self.top_k = top_k
        self.router = nn.Parameter(router.clone())
        self.gate = nn.Parameter(gate[routed].clone())                     # [N, m, H]
        self.up = nn.Parameter(up[routed].clone())
        self.down = nn.Parameter(down[:, routed].permute(1, 0, 2) * top_k)  # [N, H, m]
        self.shared_gate_proj = nn.Parameter(gate[shared].clone())          # [s, H]
        self.shared_up = nn.Parameter(up[shared].clone())
        self.shared_down = nn.Parameter(down[:, shared] * 2.0)              # [H, s]
        self.shared_gate = nn.Parameter(torch.zeros(1, gate.shape[1]))

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (ids [T, k], renormalised weights [T, k]); ties: lower id (stable).
        Always in float32, also under autocast: the choice is what bf16 would blur."""
        with torch.autocast("cpu", enabled=False):
            probs = torch.softmax(F.linear(x.float(), self.router), dim=-1)
        weights, ids = probs.sort(dim=-1, descending=True, stable=True)
        weights, ids = weights[:, :self.top_k], ids[:, :self.top_k]
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]. Every expert is computed and the unrouted ones weighted 0 (one
        dense matmul per projection: cheaper on CPU than gathering rows for training)."""
        ids, weights = self.route(x)
        n, m, h = self.gate.shape
        dense = torch.zeros(x.shape[0], n, dtype=weights.dtype).scatter(1, ids, weights)
        act = F.silu(x @ self.gate.reshape(n * m, h).T) * (x @ self.up.reshape(n * m, h).T)
        act = act * dense.repeat_interleave(m, dim=1)
        out = act @ self.down.permute(0, 2, 1).reshape(n * m, h)
        if self.shared_up.shape[0]:
            s_act = F.silu(F.linear(x, self.shared_gate_proj)) * F.linear(x, self.shared_up)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * F.linear(
                s_act, self.shared_down)
        return out

    def hf_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """This layer's tensors under Qwen2-MoE's checkpoint names, `prefix` like
        "model.layers.3.mlp."."""
        out = {f"{prefix}gate.weight": self.router.detach()}
        for e in range(self.num_experts):
            p = f"{prefix}experts.{e}."
            out[p + "gate_proj.weight"] = self.gate[e].detach()
            out[p + "up_proj.weight"] = self.up[e].detach()
            out[p + "down_proj.weight"] = self.down[e].detach()
        if self.shared_up.numel():
            for attr, name in _SHARED:
                out[f"{prefix}{name}.weight"] = getattr(self, attr).detach()
        return {k: v.contiguous() for k, v in out.items()}

    @classmethod
    def from_hf_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, num_experts: int,
                        top_k: int) -> "CarvedMoE":
        """The inverse of `hf_tensors` (resuming a carve)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.top_k = top_k

        def stack(name: str) -> torch.Tensor:
            return torch.stack([tensors[f"{prefix}experts.{e}.{name}.weight"]
                                for e in range(num_experts)]).float()

        layer.router = nn.Parameter(tensors[f"{prefix}gate.weight"].float())
        layer.gate, layer.up = nn.Parameter(stack("gate_proj")), nn.Parameter(stack("up_proj"))
        layer.down = nn.Parameter(stack("down_proj"))
        h = layer.router.shape[1]
        empty = {"shared_gate_proj": (0, h), "shared_up": (0, h), "shared_down": (h, 0),
                 "shared_gate": (1, h)}
        for attr, name in _SHARED:
            t = tensors.get(f"{prefix}{name}.weight")
            setattr(layer, attr, nn.Parameter(torch.zeros(empty[attr]) if t is None
                                              else t.float()))
        return layer
