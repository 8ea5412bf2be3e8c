"""Writing `specmoe bench spec` results: JSON, a Markdown report and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(results: dict, out_dir: Path) -> list[Path]:
    """results.json, report.md, speedup_vs_k.png, acceptance_length_vs_k.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(markdown(results))
    paths += plot(results["rows"], out_dir)
    return paths


def _int4_mode(cfg: dict, results: dict) -> str:
    """', int4 batch-invariant mode' when an int4 target ran in it (SPECMOE_INT4_BATCH_INVARIANT
    with our int4 kernel running)."""
    on = cfg.get("quantization") == "int4" and results.get("int4_batch_invariant")
    return ", int4 batch-invariant mode" if on else ""


def markdown(results: dict) -> str:
    cfg, rf = results["config"], results["roofline"]
    proposers = {"draft": f"draft {cfg['draft']} ({cfg['draft_quantization'] or cfg['dtype']})",
                 "ngram": "n-gram"}
    lines = [f"# Speculative decoding: {cfg['target']} with "
             + " and ".join(proposers[p] for p in cfg.get("proposers", proposers)),
             "", f"target {cfg.get('quantization') or cfg['dtype']} (activations "
             f"{cfg['dtype']}{_int4_mode(cfg, results)}), {cfg['max_tokens']} tokens per "
             "prompt (EOS ignored), "
             f"{cfg['num_prompts']} prompts per data set (Spec-Bench: per category); "
             f"total {results['total_seconds'] / 60:.1f} min.", "",
             "## Best K per data set (greedy)", "", *best_table(results["rows"]), "",
             "## Roofline of plain decoding", "",
             f"read bandwidth {rf['read_bandwidth_gb_s']:.1f} GB/s, weights read per token "
             f"{rf['weight_bytes_per_token'] / 1e9:.2f} GB -> ceiling "
             f"{rf['roofline_tokens_per_s']:.2f} tok/s; plain decode "
             f"{rf['plain_decode_tokens_per_s']:.2f} tok/s = "
             f"{100 * rf['fraction_of_roofline']:.0f}% of it (decode steps only; the tok/s "
             "of the tables below include each run's prefill).", *_roofline_range(rf), ""]
    if "peers" in results:
        lines += ["## Peers (same model files, same prompts, greedy)", "",
                  *peer_table(results["peers"], cfg.get("quantization")), ""]
    lines += ["## Every configuration", "", *full_table(results["rows"])]
    return "\n".join(lines) + "\n"


def best_table(rows: list[dict]) -> list[str]:
    out = ["| data set | proposer | best K | speedup | acceptance length | acceptance rate |"
           " greedy mismatches |", "|---|---|---|---|---|---|---|"]
    for (group, proposer), cands in _by(rows, temperature=0.0).items():
        best = max(cands, key=lambda r: r["speedup"])
        out.append(f"| {group} | {proposer} | {best['k']} | {best['speedup']:.2f}x | "
                   f"{best['mean_acceptance_length']:.2f} | {best['acceptance_rate']:.2f} | "
                   f"{best.get('greedy_mismatches', 0)}/{best['num_runs']} |")
    return out


def full_table(rows: list[dict]) -> list[str]:
    out = ["| data set | proposer | K | T | tok/s | speedup | AL | AR | per position | "
           "mismatches |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        mism = r.get("greedy_mismatches", "")
        out.append(f"| {r['group']} | {r['proposer']} | {r['k']} | {r['temperature']} | "
                   f"{r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | "
                   f"{r['mean_acceptance_length']:.2f} | {r['acceptance_rate']:.2f} | {pos} | "
                   f"{mism} |")
    return out


def _roofline_range(rf: dict) -> list[str]:
    """The per-run spread, when the results have it (runs before it had one probe)."""
    if "fraction_of_roofline_range" not in rf:
        return []
    (f_lo, f_hi), (b_lo, b_hi) = (rf["fraction_of_roofline_range"],
                                  rf["read_bandwidth_range_gb_s"])
    probes = ("before and after each plain run ({lo:.1f}-{hi:.1f} GB/s, the higher probe of "
              "each run; the median above) and each run is set against its own (a change of "
              "memory speed during a run understates it)" if rf.get("probes_per_run") == 2
              else "before each plain run ({lo:.1f}-{hi:.1f} GB/s; the median above) and each "
              "run is set against its own probe")
    return ["", f"The bandwidth is probed {probes.format(lo=b_lo, hi=b_hi)}: "
            f"{100 * f_lo:.0f}-{100 * f_hi:.0f}% of the roofline, median "
            f"{100 * rf['fraction_of_roofline']:.0f}%."]


def peer_table(peers: dict, quantization: str | None = None) -> list[str]:
    out = [f"Prompts: {peers['group']}; tokens/s per prompt (median).", "",
           "| mode | tok/s |", "|---|---|"]
    import statistics
    for mode, tps in peers["tokens_per_s"].items():
        out.append(f"| {mode} | {statistics.median(tps):.2f} |")
    out += ["", "| ratio (median of per-prompt ratios) | value |", "|---|---|"]
    out += [f"| {name} | {v:.2f}x |" for name, v in peers["ratios"].items()]
    if any(m.startswith("llama-cpp") for m in peers["tokens_per_s"]):
        ours = (f"re-quantised to our own {quantization} (through bf16), " if quantization
                else "dequantised, ")
        out += ["", "llama-cpp runs the GGUF file's quantised tensors (Q4_K and others); we "
                f"run them {ours}transformers dequantised, so greedy outputs may differ."]
    comparisons = peers.get("greedy_comparison", {})
    if comparisons:
        out += ["", "| greedy output | prompts that differ | first differing token |",
                "|---|---|---|"]
        for name, c in comparisons.items():
            first = ", ".join("-" if f is None else str(f) for f in c["first_difference"])
            out.append(f"| {name} | {c['differing_prompts']}/{c['num_prompts']} | {first} |")
    return out


def _by(rows: list[dict], temperature: float | None = None) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["proposer"] == "none" or (temperature is not None
                                       and r["temperature"] != temperature):
            continue
        groups.setdefault((r["group"], r["proposer"]), []).append(r)
    return groups


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Speedup and acceptance length against K, one panel per data set, one line per
    proposer and temperature."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({r["group"] for r in rows})
    paths = []
    for metric, label in (("speedup", "speedup over plain decoding"),
                          ("mean_acceptance_length", "mean acceptance length")):
        cols = min(4, len(groups))
        nrows = -(-len(groups) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
        for ax, group in zip(axes.flat, groups):
            for (g, proposer), _ in _by(rows).items():
                if g != group:
                    continue
                for temp in sorted({r["temperature"] for r in rows}):
                    pts = sorted((r["k"], r[metric]) for r in rows if r["group"] == group
                                 and r["proposer"] == proposer and r["temperature"] == temp)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{proposer} T={temp}")
            if metric == "speedup":
                ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_title(group, fontsize=9)
            ax.set_xlabel("K")
            ax.set_ylabel(label, fontsize=8)
        for ax in list(axes.flat)[len(groups):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{'speedup' if metric == 'speedup' else 'acceptance_length'}_vs_k.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
