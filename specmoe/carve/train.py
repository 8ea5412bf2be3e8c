"""Reconstruction training of one carved MoE layer: router, experts and shared gate trained
together to reproduce the dense FFN's output on cached FFN inputs (Adam on the relative
squared error, seeded minibatches). Layer-wise reconstruction as in post-training
compression (e.g. GPTQ's layer-wise objective, Frantar et al. 2023, arXiv 2210.17323), here
with the router in the loop: the top-k choice has no gradient, the kept weights do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmoe.carve.moe_layer import CarvedMoE


@dataclass(frozen=True)
class TrainSettings:
    """steps: Adam steps per layer (0: no training); batch: tokens per step; lr: for the
    expert weights, relative to their RMS (router and shared gate: `router_lr`);
    bf16_matmuls: the training steps' matmuls in bfloat16 under torch.autocast (weights,
    optimiser state and the loss stay float32; several times faster where the CPU multiplies
    bf16 natively). The errors reported are always computed in float32."""

    steps: int = 200
    batch: int = 512
    lr: float = 5e-3
    router_lr: float = 1e-2
    bf16_matmuls: bool = True

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"invalid train steps={self.steps}: must be >= 0 (0: no training)")
        if self.batch < 1:
            raise ValueError(f"invalid train batch={self.batch}: must be >= 1 tokens")
        if not (self.lr > 0 and self.router_lr > 0):
            raise ValueError(f"invalid learning rates lr={self.lr}, router_lr="
                             f"{self.router_lr}: must be > 0")


def relative_error(pred: torch.Tensor, target: torch.Tensor) -> float:
    """||pred - target||^2 / ||target||^2 over all tokens."""
    return float((pred - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-30))


def _groups(layer: CarvedMoE, s: TrainSettings) -> list[dict]:
    """Adam moves a weight by about lr per step, so each weight gets lr scaled by its own
    RMS (a step is a fixed fraction of the weight's size, whatever the model); the shared
    gate starts at zero, so it is scaled by the router's."""
    def rms(p: torch.Tensor) -> float:
        return float(p.detach().pow(2).mean().sqrt())

    router_rms = rms(layer.router) or 1e-3
    groups = [{"params": [layer.router, layer.shared_gate], "lr": s.router_lr * router_rms}]
    for p in (layer.gate, layer.up, layer.down, layer.shared_gate_proj, layer.shared_up,
              layer.shared_down):
        if p.numel():
            groups.append({"params": [p], "lr": s.lr * rms(p)})
    return groups


def train_layer(layer: CarvedMoE, x: torch.Tensor, target: torch.Tensor, s: TrainSettings,
                generator: torch.Generator, advance=None) -> tuple[float, float]:
    """Train `layer` in place on x [T, H] -> target [T, H] (float32).

    Args:
        advance: called with 1 after every step (a progress bar), or None.
    Returns:
        (relative error before, after) on all T tokens.
    """
    with torch.no_grad():
        before = relative_error(layer(x), target)
    if s.steps == 0:
        return before, before
    opt = torch.optim.Adam(_groups(layer, s))
    warm = max(1, s.steps // 10)  # Adam's first steps are full-size: ramp up, then cosine
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 0.01, 1.0, warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, s.steps - warm))], [warm])
    scale = target.pow(2).mean()
    for _ in range(s.steps):
        rows = torch.randint(0, x.shape[0], (min(s.batch, x.shape[0]),), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16_matmuls):
            pred = layer(x[rows])
        loss = (pred.float() - target[rows]).pow(2).mean() / scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if advance is not None:
            advance(1)
    with torch.no_grad():
        after = relative_error(layer(x), target)
    return before, after
