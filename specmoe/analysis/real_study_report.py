"""report.md, results.json and plots of the real-model study (`real_study`): every figure
and every answer computed from the measured numbers, nothing written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specmoe.analysis.cost_model import FIT_TOKENS  # noqa: E402

COHERE_B1_SPEEDUP = 1.95  # the source analysis' quoted single-request MoE speedup (DESIGN.md)


def write_real_outputs(results: dict, out: Path) -> None:
    """results.json, report.md and the PNG plots into `out`."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot_ratio_vs_b(results, out / "verify_ratio_vs_B.png")
    plot_speedup_vs_b(results, out / "speedup_vs_B.png")
    plot_predicted_vs_measured(results, out / "predicted_vs_measured.png")
    (out / "report.md").write_text(render_real_report(results))


def _forwards(results: dict) -> dict[tuple[str, int, int], dict]:
    return {(r["model"], r["B"], r["T"]): r for r in results["analysis"]["forwards"]}


def _is_moe(target: dict) -> bool:
    return bool(target["arch"]["num_experts"])


def ratio(fw: dict, model: str, b: int, t: int, key: str = "measured_s") -> float:
    """Tt(B, T)/Tt(B, 1) of `model` (measured, or predicted with key="predicted_s")."""
    return fw[model, b, t][key] / fw[model, b, 1][key]


def best_speedups(results: dict, model: str, key: str = "measured_speedup") -> dict[int, dict]:
    """B -> the row of the K with the highest `key` speedup."""
    best: dict[int, dict] = {}
    for r in results["analysis"]["speedups"]:
        if r["model"] == model and (r["B"] not in best or r[key] > best[r["B"]][key]):
            best[r["B"]] = r
    return dict(sorted(best.items()))


def _ratio_table(results: dict, t: int) -> list[str]:
    fw = _forwards(results)
    names = [x["model"] for x in results["targets"]]
    bs = results["config"]["batch_sizes"]
    lines = ["| B | " + " | ".join(f"{n}" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for b in bs:
        lines.append(f"| {b} | " + " | ".join(
            f"{ratio(fw, n, b, t):.2f} ({ratio(fw, n, b, t, 'predicted_s'):.2f})"
            for n in names) + " |")
    return lines


def _tt_table(results: dict, model: str) -> list[str]:
    fw = _forwards(results)
    cfg = results["config"]
    ts = cfg["num_tokens"]
    lines = ["| B \\ T | " + " | ".join(map(str, ts)) + " |", "|---" * (len(ts) + 1) + "|"]
    for b in cfg["batch_sizes"]:
        cells = []
        for t in ts:
            r = fw[model, b, t]
            u = f", {r['unique_experts']:.1f} exp" if r.get("unique_experts") else ""
            cells.append(f"{r['measured_s'] * 1e3:.1f}{u}")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def _speedup_table(results: dict, model: str) -> list[str]:
    rows = {(r["B"], r["K"]): r for r in results["analysis"]["speedups"]
            if r["model"] == model}
    ks = results["config"]["ks"]
    lines = ["| B \\ K | " + " | ".join(map(str, ks)) + " |", "|---" * (len(ks) + 1) + "|"]
    for b in results["config"]["e2e_batch_sizes"]:
        lines.append(f"| {b} | " + " | ".join(
            f"**{rows[b, k]['measured_speedup']:.2f}** ({rows[b, k]['cost_model_speedup']:.2f},"
            f" AL {rows[b, k]['AL']:.2f})" for k in ks) + " |")
    return lines


def _error_lines(results: dict) -> list[str]:
    a = results["analysis"]
    unfit = f"Tt (T>={max(FIT_TOKENS) + 1})"
    lines = [f"| model | S: forward times | S: cost model | S: Amdahl | {unfit}: cost model "
             f"| {unfit}: Amdahl |", "|---|---|---|---|---|---|"]
    for scope, e in a["speedup_errors"].items():
        fe = a["forward_errors"].get(scope)
        tt = (f"{fe['cost_model']['median']:.1%} | {fe['amdahl']['median']:.1%}" if fe
              else "- | -")
        lines.append(f"| {scope} | {e['forward_times']['median']:.1%} (max "
                     f"{e['forward_times']['max']:.0%}) | {e['cost_model']['median']:.1%} (max "
                     f"{e['cost_model']['max']:.0%}) | {e['amdahl']['median']:.1%} | {tt} |")
    return lines


def routing_lines(results: dict, target: dict) -> list[str]:
    """Unique experts per layer over W consecutive real tokens (the B = 1 grid column)
    against independent uniform routing, N (1 - (1 - k/N)^W)."""
    n, k = target["arch"]["num_experts"], target["arch"]["top_k"]
    fw = _forwards(results)
    lines = ["| W tokens | unique experts (measured) | independent uniform | fewer |",
             "|---|---|---|---|"]
    for t in results["config"]["num_tokens"]:
        u = fw[target["model"], 1, t]["unique_experts"]
        ind = n * (1 - (1 - k / n) ** t)
        lines.append(f"| {t} | {u:.1f} | {ind:.1f} | {1 - u / ind:.0%} |")
    return lines


def answers(results: dict) -> list[str]:
    """The study's four questions, answered from the numbers (MoE against dense)."""
    moe = [t["model"] for t in results["targets"] if _is_moe(t)]
    dense = [t["model"] for t in results["targets"] if not _is_moe(t)]
    out = []
    fw = _forwards(results)
    cfg = results["config"]
    bs = cfg["batch_sizes"]
    t = min(5, max(cfg["num_tokens"]))
    if moe and dense:
        m, d = moe[0], dense[0]
        rm = [ratio(fw, m, b, t) for b in bs]
        rd = [ratio(fw, d, b, t) for b in bs]
        flatter = sum(x < y for x, y in zip(rm, rd))
        out.append(f"1. **Verification cost ratio Tt(B, {t})/Tt(B, 1)**: {m} "
                   f"{rm[0]:.2f} at B={bs[0]} to {rm[-1]:.2f} at B={bs[-1]}; {d} {rd[0]:.2f} "
                   f"to {rd[-1]:.2f}. The MoE's ratio is lower at {flatter} of {len(bs)} "
                   f"batch sizes.")
    out.append("2. **Best-K speedup against B** (measured, end to end):")
    for name in moe + dense:
        best = best_speedups(results, name)
        peak = max(best, key=lambda b: best[b]["measured_speedup"])
        inner = 0 < list(best).index(peak) < len(best) - 1
        out.append(f"   - {name}: " + ", ".join(
            f"B={b} {r['measured_speedup']:.2f}x (K={r['K']})" for b, r in best.items())
            + f"; {'non-monotonic in B, ' if inner else ''}peak at B={peak}.")
    if moe and dense:
        bm, bd = best_speedups(results, moe[0]), best_speedups(results, dense[0])
        higher = [b for b in bm if b in bd and bm[b]["measured_speedup"]
                  > bd[b]["measured_speedup"]]
        where = f"at B = {', '.join(map(str, higher))}" if higher else "at no batch size"
        out.append(f"   - The MoE's best speedup is higher than dense {where}.")
        one = bm.get(1)
        if one:
            out.append(f"3. **B = 1**: the MoE's best speedup {one['measured_speedup']:.2f}x "
                       f"(K={one['K']}) against Cohere's {COHERE_B1_SPEEDUP}x.")
    errs = results["analysis"]["speedup_errors"]["all"]
    out.append(f"4. **Amdahl against the cost model**: median error of the predicted "
               f"speedups {errs['amdahl']['median']:.1%} (Amdahl) against "
               f"{errs['cost_model']['median']:.1%} (cost model) and "
               f"{errs['forward_times']['median']:.1%} (measured forward times); target "
               f"<= 10% for the cost model: "
               f"{'met' if errs['cost_model']['median'] <= 0.10 else 'NOT met'}.")
    return out


def _identical(results: dict) -> str:
    rows = results["analysis"]["speedups"]
    return f"{sum(r['identical'] for r in rows)} of {len(rows)}"


def render_real_report(results: dict) -> str:
    cfg, m = results["config"], results["machine"]
    names = [t["model"] for t in results["targets"]]
    lines = [
        "# MoE x speculation on real models", "",
        f"Targets {', '.join(names)}, each with draft {cfg['draft']}; {cfg['dtype']}; "
        f"decode read bandwidth {m['bandwidth'] / 1e9:.1f} GB/s (one-row `linear` probe), "
        f"stream {m['stream_bandwidth'] / 1e9:.1f} GB/s; {results['seconds'] / 60:.0f} min.",
        "",
        f"Tt(B, T): min of {cfg['reps']} forwards through the engine's model runner, "
        f"{cfg['context_len']} tokens of held-out corpus text in each request's KV cache, "
        "the text's next T tokens fed. End to end: the batched engine, plain and K = "
        f"{', '.join(map(str, cfg['ks']))} per request, chat prompts of at most "
        f"{cfg['prompt_tokens']} question tokens, {cfg['max_tokens']} greedy tokens each, "
        f"decode phase timed, median of "
        f"{cfg['e2e_reps']} interleaved runs. Greedy outputs identical to plain decoding in "
        f"{_identical(results)} speculative (B, K) cells.", "",
        "## Answers", "", *answers(results), "",
        "## Verification cost ratio Tt(B, T)/Tt(B, 1), measured (cost model)", ""]
    for t in sorted({min(5, max(cfg["num_tokens"])), max(cfg["num_tokens"])}):
        lines += [f"T = {t}:", "", *_ratio_table(results, t), ""]
    lines += ["## End-to-end speedup, measured (cost model, acceptance length)", ""]
    for name in names:
        lines += [f"### {name}", "", *_speedup_table(results, name), ""]
    lines += ["## Prediction errors (median relative)", "",
              "S: end-to-end speedups over B x K; Tt: verification forward times. Every "
              "prediction uses the run's acceptance lengths and the engine time per step "
              f"measured on plain runs; the cost model is fitted on T in {list(FIT_TOKENS)}.", "",
              *_error_lines(results), "",
              f"Cost model coefficients: {results['analysis']['cost_model']}", ""]
    for t in results["targets"]:
        lines += [f"## Tt(B, T) of {t['model']}, ms (unique experts per layer)", "",
                  *_tt_table(results, t["model"]), ""]
        if _is_moe(t):
            lines += [f"Routing of {t['model']} on held-out text (B = 1):", "",
                      *routing_lines(results, t), ""]
    lines += ["![ratio](verify_ratio_vs_B.png) ![speedup](speedup_vs_B.png) "
              "![fit](predicted_vs_measured.png)", ""]
    return "\n".join(lines)


def plot_ratio_vs_b(results: dict, path: Path) -> None:
    """Tt(B, K + 1)/Tt(B, 1) against B for every target, a line per K + 1 (solid: measured,
    dashed: cost model)."""
    fw = _forwards(results)
    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for t_i, t in enumerate(x for x in (2, 5, 9) if x in cfg["num_tokens"]):
        for target, style in zip(results["targets"], ("-", ":")):
            name = target["model"]
            ax.plot(cfg["batch_sizes"], [ratio(fw, name, b, t) for b in cfg["batch_sizes"]],
                    style, marker="o", ms=3, color=f"C{t_i}", label=f"{name}, T={t}")
    _finish_b_plot(fig, ax, "Tt(B, T) / Tt(B, 1)", path)


def _finish_b_plot(fig, ax, ylabel: str, path: Path) -> None:
    """Log2 batch-size axis, labels, grid and legend; saved to `path` and closed."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup_vs_b(results: dict, path: Path) -> None:
    """Best-K measured speedup against B per target, with the cost model's best-K."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, target in enumerate(results["targets"]):
        name = target["model"]
        best = best_speedups(results, name)
        pred = best_speedups(results, name, "cost_model_speedup")
        ax.plot(list(best), [r["measured_speedup"] for r in best.values()], "o-",
                color=f"C{i}", label=f"{name} measured")
        ax.plot(list(pred), [r["cost_model_speedup"] for r in pred.values()], "--",
                color=f"C{i}", label=f"{name} cost model")
    ax.axhline(1.0, color="gray", lw=0.8)
    _finish_b_plot(fig, ax, "best-K speedup", path)


def plot_predicted_vs_measured(results: dict, path: Path) -> None:
    rows = results["analysis"]["speedups"]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for i, target in enumerate(results["targets"]):
        pts = [r for r in rows if r["model"] == target["model"]]
        ax.scatter([r["measured_speedup"] for r in pts], [r["cost_model_speedup"] for r in pts],
                   s=10, color=f"C{i}", label=target["model"])
    lim = [0, max(max(r["measured_speedup"], r["cost_model_speedup"]) for r in rows) * 1.05]
    ax.plot(lim, lim, color="gray", lw=0.8)
    ax.set_xlabel("measured speedup")
    ax.set_ylabel("cost model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
