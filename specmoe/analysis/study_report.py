"""report.md of `specmoe study`: tables of every measured figure and findings in plain words,
computed from the numbers (nothing in the findings is written by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from specmoe.analysis.cost_model import FIT_TOKENS
from specmoe.analysis.study_findings import (finding_tokens, findings, shape_extras,
                                              sparsity, verification_ratio)


def write_outputs(results: dict, out: Path, routing_analysis=None) -> None:
    """results.json (every raw figure), the PNG plots and report.md into `out`; with a
    `RoutingAnalysis`, its overlap and unique-expert plots too."""
    from specmoe.analysis import study_plots as plots
    if routing_analysis is not None:
        from specmoe.analysis import routing_plots as rp
        rp.plot_overlap(routing_analysis, out / rp.OVERLAP_PNG)
        rp.plot_unique_experts(routing_analysis, out / rp.UNIQUE_PNG)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_jsonable))
    presets = results["presets"]
    plots.plot_tt_ratio(presets, out / "tt_ratio_vs_T.png")
    if any(res["preset"]["num_experts"] for res in presets.values()):
        plots.plot_unique_per_step(presets, out / "unique_experts_per_step.png")
    plots.plot_cost_fit(presets, out / "cost_model_fit.png")
    moe = {n for n, res in presets.items() if res["preset"]["num_experts"]}
    plots.plot_speedup(results["speedup"], moe, out / "speedup_vs_B.png")
    (out / "report.md").write_text(render_report(results))


def _jsonable(x):
    if isinstance(x, tuple):
        return list(x)
    return float(x)


def verification_ratio_table(presets: dict[str, dict], num_tokens: int) -> list[str]:
    """Markdown rows: Tt(B, T)/Tt(B, 1) per preset (columns) and B (rows)."""
    names = list(presets)
    batch_sizes = sorted({p["B"] for res in presets.values() for p in res["points"]})
    lines = ["| B | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for b in batch_sizes:
        cells = [verification_ratio(presets[n], b, num_tokens) for n in names]
        lines.append(f"| {b} | " + " | ".join("-" if c is None else f"{c:.2f}"
                                               for c in cells) + " |")
    return lines


def tt_table(res: dict) -> list[str]:
    """Markdown rows: Tt(B, T) min (median) in ms, B rows and T columns."""
    ts = sorted({p["T"] for p in res["points"]})
    pts = {(p["B"], p["T"]): p for p in res["points"]}
    lines = ["| B \\ T | " + " | ".join(str(t) for t in ts) + " |", "|---" * (len(ts) + 1) + "|"]
    for b in sorted({p["B"] for p in res["points"]}):
        lines.append(f"| {b} | " + " | ".join(
            f"{pts[b, t]['min_s'] * 1e3:.1f} ({pts[b, t]['median_s'] * 1e3:.1f})"
            for t in ts) + " |")
    return lines


def preset_table(presets: dict[str, dict], llc: int | None) -> list[str]:
    lines = ["| preset | shape | total params | active params | weight bytes (no embedding) "
             "| x LLC | routing |",
             "|---|---|---|---|---|---|---|"]
    for name, res in presets.items():
        p, s = res["preset"], res["size"]
        shape = (f"L={p['num_layers']}, H={p['hidden_size']}, "
                 + (f"N={p['num_experts']}, k={p['top_k']} (k/N {sparsity(p):.1%}), expert "
                    f"width {p['intermediate_size']}" if p["num_experts"]
                    else f"MLP width {p['intermediate_size']}")
                 + "".join(f", {x}" for x in shape_extras(p)))
        routing = res.get("routing") or {}
        lines.append(f"| {name} | {shape} | {s['total_params'] / 1e6:.0f} M | "
                     f"{s['active_params'] / 1e6:.0f} M | {s['weight_bytes'] / 2**20:.0f} MiB | "
                     f"{s['weight_bytes'] / llc if llc else float('nan'):.0f} | "
                     f"{_routing_text(routing)} |")
    return lines


def _routing_text(routing: dict) -> str:
    if not routing:
        return "dense"
    if "overlap" in routing:
        return f"{routing['name']}, overlap {routing['overlap']}"
    return routing["name"]


def cost_model_lines(fit: dict) -> list[str]:
    lines = ["| scope | model | median error | max error |", "|---|---|---|---|"]
    for scope, models in fit["errors"].items():
        for label, e in models.items():
            lines.append(f"| {scope} | {label} | {e['median']:.1%} | {e['max']:.1%} |")
    lines += ["", "Per preset, median error over every point (cost model / Amdahl): "
              + "; ".join(f"{n} {e:.1%} / {fit['errors']['all']['amdahl']['per_preset_median'][n]:.1%}"
                          for n, e in fit["errors"]["all"]["cost_model"]["per_preset_median"]
                          .items()) + ".",
              "", f"Fitted coefficients (fitted on T in {list(FIT_TOKENS)}): "
              + ", ".join(f"{k} {v:.3g}" for k, v in fit["coefficients"].items()) + "."]
    return lines


def speedup_lines(synthesis: dict[str, dict]) -> list[str]:
    batch_sizes = sorted({int(b) for t in synthesis.values() for b in t["best"]})
    lines = ["| preset | " + " | ".join(f"B={b}" for b in batch_sizes) + " | speculation stops "
             "paying at |", "|---" * (len(batch_sizes) + 2) + "|"]
    for name, table in synthesis.items():
        best = {int(b): v for b, v in table["best"].items()}
        cells = [f"{best[b]['speedup']:.2f}x (K={best[b]['K']})" if b in best else "-"
                 for b in batch_sizes]
        stop = table["breakeven_batch_size"]
        lines.append(f"| {name} | " + " | ".join(cells) + " | "
                     + (f"B={stop}" if stop else "never, in the grid") + " |")
    return lines


def render_report(r: dict) -> str:
    """The whole report.md."""
    presets, llc = r["presets"], r["machine"].get("last_level_cache_bytes")
    m = r["machine"]
    out = ["# specmoe study: speculative decoding on MoE vs dense", "",
           f"Run in {r['seconds']} s on {m['device']} ({m['cpu']}, torch threads: "
           f"{m['torch_threads']}); last-level cache {llc / 2**20 if llc else float('nan'):.0f} MiB; read "
           f"bandwidth {m['bandwidth'] / 1e9:.1f} GB/s (one-row linear), "
           f"{m['stream_bandwidth'] / 1e9:.1f} GB/s (tensor sum); matmul throughput "
           f"{min(m['flops']) / 1e9:.0f}-{max(m['flops']) / 1e9:.0f} GFLOP/s over "
           f"{m['probe_rows'][0]}-{m['probe_rows'][-1]} rows (weights streamed from memory).", "",
           "## Findings", "", *findings(r), *[f"- Warning: {w}" for w in r.get("warnings", [])],
           "", "## Presets (synthetic weights, "
           f"{r['config']['dtype']}, context {r['config']['context_len']} tokens)", "",
           *preset_table(presets, llc), "", *_draft_line(r.get("draft")), ""]
    t = finding_tokens(presets)
    out += [f"## Verification cost Tt(B, {t}) / Tt(B, 1) (K = {t - 1})", "",
            *verification_ratio_table(presets, t), "",
            "![Tt ratio](tt_ratio_vs_T.png)", "", *_unique_plot_line(presets),
            "## Cost model", "", *cost_model_lines(r["cost_model"]), "",
            "![cost model](cost_model_fit.png)", "",
            "## Speedup S(B, K) = AL(K) / (Tt(B, K+1)/Tt(B, 1) + K Td(B, 1)/Tt(B, 1))", "",
            f"Acceptance lengths: {r['acceptance']['source']}: "
            + ", ".join(f"AL({k}) = {v:.2f}" for k, v in sorted(
                (int(k), v) for k, v in r["acceptance"]["lengths"].items())) + ".", "",
            *speedup_lines(r["speedup"]), "", "![speedup](speedup_vs_B.png)", ""]
    out += _e2e_section(r.get("e2e"))
    out += _routing_section(r.get("learned_routing"))
    out += ["## Raw timings, Tt(B, T) in ms: min (median)", ""]
    for name, res in presets.items():
        out += [f"### {name}", "", *tt_table(res), ""]
    return "\n".join(out) + "\n"


def _draft_line(draft: dict | None) -> list[str]:
    if not draft:
        return ["Draft cost: given as a ratio, not measured."]
    p, s = draft["preset"], draft["size"]
    times = ", ".join(f"B={x['B']} {x['min_s'] * 1e3:.1f} ms" for x in draft["points"])
    return [f"Draft preset: dense, L={p['num_layers']}, H={p['hidden_size']}, MLP width "
            f"{p['intermediate_size']}, {s['active_params'] / 1e6:.0f} M parameters "
            f"({s['weight_bytes'] / 2**20:.0f} MiB); Td(B, 1): {times}."]


def _e2e_section(e2e: dict | None) -> list[str]:
    if not e2e:
        return []
    c = e2e["config"]
    lines = [f"## Predicted vs measured speedup, end to end ({c['model']} + {c['draft']}, "
             f"K={c['k']}, {c['max_tokens']} greedy tokens per request, {c['dtype']})", "",
             "| B | AL | measured speedup | predicted from forward times | error |",
             "|---|---|---|---|---|"]
    for r in e2e["rows"]:
        lines.append(f"| {r['B']} | {r['AL']:.2f} | {r['measured_speedup']:.2f}x | "
                     f"{r['predicted_speedup']:.2f}x | {r['error']:.1%} |")
    return lines + [""]


def _unique_plot_line(presets: dict[str, dict]) -> list[str]:
    if not any(res["preset"]["num_experts"] for res in presets.values()):
        return []
    return ["![unique experts](unique_experts_per_step.png)", ""]


def _routing_section(lr: dict | None) -> list[str]:
    if not lr:
        return []
    from specmoe.analysis.routing_plots import OVERLAP_PNG, UNIQUE_PNG
    title = ("Routing of a trace" if lr["source"].startswith("trace")
             else "Learned routing of a real MoE on real prompts")
    return [f"## {title}", "", *lr["summary_lines"], "", f"![overlap]({OVERLAP_PNG})", "",
            f"![unique vs W]({UNIQUE_PNG})", ""]
