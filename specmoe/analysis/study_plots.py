"""PNG plots of `specmoe study` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _points(res: dict, batch_size: int) -> list[dict]:
    return sorted((p for p in res["points"] if p["B"] == batch_size), key=lambda p: p["T"])


def plot_tt_ratio(presets: dict[str, dict], path: Path) -> None:
    """Per preset: measured Tt(B, T)/Tt(B, 1) against T (solid), one line per B, and the
    cost model's prediction (dashed)."""
    ncols = min(3, len(presets))
    nrows = -(-len(presets) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.6 * nrows), sharey=True,
                             squeeze=False)
    for ax in axes.flat[len(presets):]:
        ax.set_visible(False)
    for ax, (name, res) in zip(axes.flat, presets.items()):
        batch_sizes = sorted({p["B"] for p in res["points"]})
        cmap = plt.get_cmap("viridis", len(batch_sizes))
        for i, b in enumerate(batch_sizes):
            pts = _points(res, b)
            base, t = pts[0], [p["T"] for p in pts]
            ax.plot(t, [p["min_s"] / base["min_s"] for p in pts], "o-", color=cmap(i),
                    label=f"B={b}", ms=3)
            if "predicted_s" in base:
                ax.plot(t, [p["predicted_s"] / base["predicted_s"] for p in pts], "--",
                        color=cmap(i), lw=1)
        ax.set_title(name)
        ax.set_xlabel("T, tokens per request (K + 1)")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("Tt(B, T) / Tt(B, 1)")
    axes.flat[0].legend(fontsize=7, title="solid: measured\ndashed: cost model",
                        title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(synthesis: dict[str, dict], moe_names: set[str], path: Path) -> None:
    """Best-K speedup S(B) per preset against B; MoE solid, dense dashed; best K labelled."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, table in synthesis.items():
        best = sorted(table["best"].items())
        if not best:
            continue
        b = [int(x) for x, _ in best]
        s = [v["speedup"] for _, v in best]
        line, = ax.plot(b, s, "o-" if name in moe_names else "s--", label=name)
        for x, (_, v) in zip(b, best):
            ax.annotate(f"K={v['K']}", (x, v["speedup"]), fontsize=6, color=line.get_color(),
                        xytext=(2, 3), textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=1)
    _finish_log2(fig, ax, path, "batch size B (concurrent requests)",
                 "predicted speedup S(B, best K)",
                 "Speculative speedup from measured Tt and real acceptance lengths", 8)


def plot_cost_fit(presets: dict[str, dict], path: Path) -> None:
    """Predicted against measured Tt for the cost model and the Amdahl estimate (log-log)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharex=True, sharey=True)
    for ax, (key, title) in zip(axes, (("predicted_s", "cost model (x: T = 1, fitted)"),
                                       ("amdahl_s", "Amdahl estimate (x: T = 1, its anchor)"))):
        for name, res in presets.items():
            pts = [p for p in res["points"] if key in p]
            dots = ax.scatter([p["min_s"] * 1e3 for p in pts if p["T"] > 1],
                              [p[key] * 1e3 for p in pts if p["T"] > 1], s=8, label=name)
            ax.scatter([p["min_s"] * 1e3 for p in pts if p["T"] == 1],
                       [p[key] * 1e3 for p in pts if p["T"] == 1], s=18, marker="x",
                       color=dots.get_facecolor()[0])
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("measured Tt, ms (min)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("predicted Tt, ms")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_unique_per_step(presets: dict[str, dict], path: Path) -> None:
    """Unique experts a forward touched (mean over layers) against the step's tokens B T,
    MoE presets only, with the uniform-independence closed form dashed."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in presets.items():
        pts = sorted((p for p in res["points"] if "unique_experts" in p),
                     key=lambda p: p["B"] * p["T"])
        if not pts:
            continue
        n = res["preset"]["num_experts"]
        line, = ax.plot([p["B"] * p["T"] for p in pts],
                        [p["unique_experts"] / n for p in pts], "o", ms=3,
                        label=f"{name} measured")
        ax.plot([p["B"] * p["T"] for p in pts], [p["uniform_unique_experts"] / n for p in pts],
                "--", color=line.get_color(), lw=1, label=f"{name} uniform independent")
    _finish_log2(fig, ax, path, "tokens per forward, B x T", "unique experts / N",
                 "Experts read per forward (the union of the step's routing)", 7)


def _finish_log2(fig, ax, path: Path, xlabel: str, ylabel: str, title: str,
                 legend_size: int) -> None:
    """Log2 x axis, labels, grid and legend; save to `path` and close."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
