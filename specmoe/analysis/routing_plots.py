"""Plots of a `RoutingAnalysis` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specmoe.analysis.routing_stats import RoutingAnalysis  # noqa: E402


OVERLAP_PNG = "overlap_vs_distance.png"
UNIQUE_PNG = "unique_experts_vs_window.png"

def plot_overlap(analysis: RoutingAnalysis, path: str | Path) -> Path:
    """PNG of the mean expert overlap |E_t ∩ E_{t+d}| / k against the distance d (mean over
    layers, each layer faint), with the overlap of independent tokens under uniform and
    popularity-weighted routing as labelled horizontal lines. Returns the path."""
    a, d = analysis, analysis.distances
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i in range(len(a.moe_layers)):
        ax.plot(d, a.overlap[:, i], color="tab:blue", alpha=0.15, lw=1)
    ax.plot(d, a.overlap_mean, "o-", color="tab:blue", lw=2, label="measured (mean of layers)")
    ax.axhline(a.overlap_uniform, color="tab:gray", ls="--",
               label=f"independent, uniform: $k/N$ = {a.overlap_uniform:.3f}")
    pop = float(a.overlap_popularity.mean())
    ax.axhline(pop, color="tab:orange", ls=":",
               label=rf"independent, popularity-weighted: $\sum_e q_e^2/k$ = {pop:.3f}")
    ax.set(xlabel="distance d (tokens)", ylabel=r"mean $|E_t \cap E_{t+d}|\,/\,k$", xticks=d,
           ylim=(0, 1), title=_title(a, "Expert overlap between tokens d apart"))
    return _save(fig, ax, path)


def plot_unique_experts(analysis: RoutingAnalysis, path: str | Path) -> Path:
    """PNG of the mean unique experts in a window of W consecutive tokens against W (mean
    over layers, each layer faint), with both independence baselines (uniform
    N(1 - (1 - k/N)^W) and popularity-weighted sum_e [1 - (1 - q_e)^W]). Returns the path."""
    a, w = analysis, analysis.windows
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i in range(len(a.moe_layers)):
        ax.plot(w, a.unique[:, i], color="tab:blue", alpha=0.15, lw=1)
    ax.plot(w, a.unique_mean, "o-", color="tab:blue", lw=2, label="measured (mean of layers)")
    ax.plot(w, a.unique_uniform, "s--", color="tab:gray",
            label=r"independent, uniform: $N\,(1-(1-k/N)^W)$")
    ax.plot(w, a.unique_popularity_mean, "^:", color="tab:orange",
            label=r"independent, popularity-weighted: $\sum_e\,[1-(1-q_e)^W]$")
    ax.set(xlabel="window W (consecutive tokens)", ylabel="unique experts per layer",
           xticks=w, ylim=(0, None),
           title=_title(a, "Unique experts per window vs independence"))
    return _save(fig, ax, path)


def _title(a: RoutingAnalysis, what: str) -> str:
    model = f"{a.model}, " if a.model else ""
    return f"{what}\n({model}N={a.num_experts}, k={a.top_k}, {a.num_tokens} tokens)"


def _save(fig, ax, path: str | Path) -> Path:
    path = Path(path)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
