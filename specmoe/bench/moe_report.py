"""Writing `specmoe bench moe` results: JSON, a Markdown report and a PNG of GB/s against T."""

from __future__ import annotations

import json
from pathlib import Path

PNG = "moe_gb_s_vs_tokens.png"
PART_TITLES = {"layer": "one MoE layer", "model": "whole-model step"}


def write_report(results: dict, out_dir: Path) -> list[Path]:
    """results.json, report.md and moe_gb_s_vs_tokens.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(markdown(results))
    paths.append(plot(results, out_dir / PNG))
    return paths


def markdown(results: dict) -> str:
    cfg, env = results["config"], results["environment"]
    base = cfg["baseline"]
    overlap = "" if cfg.get("overlap") is None else f" (adjacent-token overlap {cfg['overlap']:g})"
    lines = [f"# MoE backends: {', '.join(cfg['backends'])}" + (" (smoke shapes)"
                                                                 if cfg["smoke"] else ""), "",
             f"{cfg['dtype']} on {env['device']}, torch {env['torch_version']} on "
             f"{env['torch_num_threads']} thread{'s' * (env['torch_num_threads'] != 1)} of "
             f"{env['cpu_count']} CPUs (load average "
             f"{env['load_average_start']:.1f} -> {env['load_average_end']:.1f}); native "
             f"kernel: {env['native_kernel']}; weights in huge pages: "
             f"{'yes' if env['huge_pages'] else 'no'}. Routing: "
             f"{', '.join(sorted({p['routing'] for p in results['presets']}))}{overlap}, "
             f"forced, one draw per layer and repetition, the same for every backend. "
             f"{cfg['repeats']} repetitions, backends in turn within each; whole-model step: "
             f"one sequence of T new tokens after {cfg['context_len']} cached, logits for "
             f"all T. {_flush(env)} Total {_duration(results['total_seconds'])}.", "",
             f"**Probes** (same run): read bandwidth {_probes(env)} GB/s "
             f"({env['probe_bytes'] / 2**30:.1f} GiB"
             f"{' in huge pages' if env['huge_pages'] else ''}; each part is set against "
             f"the higher probe around it); multiply peak {env['peak_flops'] / 1e9:.0f} "
             f"GFLOP/s ({env['peak_source']}).", "",
             f"**Targets** (fractions of the roofline; reported, not asserted): "
             f"{cfg['targets']}.", "",
             *target_summary(results), "",
             *[f"**Caveat**: {c}." for c in caveats(results)],
             *([""] if caveats(results) else [])]
    for preset in results["presets"]:
        s = preset["shape"]
        lines += [f"## {preset['name']}", "",
                  f"{preset['description']}: N={s['num_experts']}, k={s['top_k']}, expert "
                  f"width {s['moe_intermediate_size']}, H={s['hidden_size']}, "
                  f"{s['num_layers']} layers.", ""]
        for part, data in preset["parts"].items():
            lines += [f"### {PART_TITLES[part]}", "",
                      f"One expert {data['expert_bytes'] / 2**20:.2f} MiB; read bandwidth "
                      f"{data['read_bandwidth'] / 1e9:.1f} GB/s.{_agreement(data, base)}", "",
                      *point_table(data["points"], base), ""]
    lines += ["## Columns", "", *COLUMNS]
    return "\n".join(lines) + "\n"


COLUMNS = [
    "- **unique experts**: distinct experts per MoE layer (mean over layers and repetitions):",
    "  the experts whose weights the step reads.",
    "- **MB read**: unique experts x one expert's bytes, plus every weight the step always reads",
    "  (router; for the whole model also attention, norms, LM head, the T embedding rows and",
    "  the KV cache); mean over repetitions.",
    "- **GFLOP**: 2 x active parameters x T (matmuls only; attention scores left out).",
    "- **floor**: max(bytes / probed bandwidth, flops / probed peak); **bound**: which is larger.",
    "- **min, median**: the backend's time over the repetitions.",
    "- **x grouped**: the baseline's time (the loop backend, grouped, where it ran) / this",
    "  backend's time in the same repetition (same routing and input), median (above 1: faster",
    "  than the baseline).",
    "- **GB/s, of BW**: bytes read / time of the best repetition, and its fraction of the",
    "  probed read bandwidth.",
    "- **GF/s, of peak**: flops / min time, and its fraction of the probed multiply peak.",
    "- **time / floor**: the best repetition's time over its floor (1.00 = at the roofline).",
    "- **target**: PASS or FAIL with the value reached: at small T the fraction of the",
    "  bandwidth roofline (of BW), at large T floor / time; blank between.",
]


def _flush(env: dict) -> str:
    if not env["flush_bytes"]:
        return "No cache flush."
    return (f"Caches flushed before every timed call (a {env['flush_bytes'] / 2**20:.0f} MiB "
            "read).")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _probes(env: dict) -> str:
    values = [p["bytes_per_s"] / 1e9 for p in env["read_bandwidth_probes"]]
    return " / ".join(f"{v:.1f}" for v in values)


def _agreement(data: dict, base: str) -> str:
    worst: dict[str, float] = {}
    for p in data["points"]:
        for b, d in p.get("relative_difference_vs_baseline", {}).items():
            if b != base:
                worst[b] = max(worst.get(b, 0.0), d)
    if not worst:
        return ""
    return " Outputs against " + base + ": " + ", ".join(
        f"{b} within {d:.1e} of the largest value" for b, d in worst.items()) + "."


def point_table(points: list[dict], base: str) -> list[str]:
    out = [f"| T | unique experts | MB read | GFLOP | floor (ms) | bound | backend | min (ms) | "
           f"median (ms) | x {base} | GB/s | of BW | GF/s | of peak | time / floor | "
           "target |", "|" + "---|" * 16]
    for p in points:
        first = True
        for b, s in p["backends"].items():
            head = (f"| {p['T']} | {p['unique_experts']:.1f} | {p['bytes'] / 1e6:.1f} | "
                    f"{p['flops'] / 1e9:.2f} | {1e3 * p['floor_s']:.2f} | {p['bound']} "
                    if first else "| | | | | | ")
            first = False
            out.append(f"{head}| {b} | {1e3 * s['min_s']:.2f} | {1e3 * s['median_s']:.2f} | "
                       f"{s['speedup_vs_baseline']['median']:.2f}x | {s['gb_s']:.1f} | "
                       f"{_pct(s['bandwidth_fraction'])} | {s['gf_s']:.1f} | "
                       f"{_pct(s['peak_fraction'])} | {s['time_over_floor']:.2f} | "
                       f"{target_cell(s['target'])} |")
    return out


def target_cell(target: dict | None) -> str:
    if target is None:
        return ""
    what = "of BW" if target["kind"] == "bandwidth" else "of floor"
    return (f"{'PASS' if target['passed'] else 'FAIL'} {_pct(target['value'])} {what} "
            f"(>= {_pct(target['required'])})")


def target_summary(results: dict) -> list[str]:
    """One row per preset, part and backend: the targets met of those evaluated (none on
    smoke shapes, which measure nothing)."""
    if results["config"]["smoke"]:
        return ["Targets not evaluated: a smoke run's shapes fit in cache and measure nothing."]
    backends = results["config"]["backends"]
    out = ["| preset | part | " + " | ".join(backends) + " |",
           "|---|---|" + "---|" * len(backends)]
    for preset in results["presets"]:
        for part, data in preset["parts"].items():
            cells = []
            for b in backends:
                ts = [p["backends"][b]["target"] for p in data["points"]
                      if p["backends"][b]["target"] is not None]
                met = sum(t["passed"] for t in ts)
                cells.append(f"{met}/{len(ts)} targets met" if ts else "-")
            out.append(f"| {preset['name']} | {part} | " + " | ".join(cells) + " |")
    return out


def caveats(results: dict) -> list[str]:
    """A busy machine, probes that disagree by more than 20%, smoke shapes."""
    env, out = results["environment"], []
    if results["config"]["smoke"]:
        out.append("smoke shapes: the weights fit in cache and the figures measure nothing")
    busy = env["load_average_start"] + env["torch_num_threads"]
    if busy > env["cpu_count"] + 0.5:
        out.append(f"the machine was busy (load average {env['load_average_start']:.1f} "
                   f"before the run, plus {env['torch_num_threads']} torch threads, on "
                   f"{env['cpu_count']} CPUs)")
    bws = [p["bytes_per_s"] for p in env["read_bandwidth_probes"]]
    if bws and max(bws) > 1.2 * min(bws):
        out.append(f"the read bandwidth moved during the run ({min(bws) / 1e9:.1f} to "
                   f"{max(bws) / 1e9:.1f} GB/s): the memory phase changed; fractions are "
                   "set against the higher probe around each part")
    above = [f"{preset['name']} {part} T={p['T']} {b}"
             for preset in results["presets"] for part, data in preset["parts"].items()
             for p in data["points"] for b, st in p["backends"].items()
             if st["bandwidth_fraction"] > 1.0]
    if above:
        out.append(f"{len(above)} points read faster than the bandwidth probe (first: "
                   f"{above[0]}): the probe caught a slower memory phase than the timings, or "
                   "the caches still held part of the weights; their fractions overstate")
    return out


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def plot(results: dict, path: Path) -> Path:
    """GB/s (best repetition) against T per backend, one panel per preset and part, with the
    part's probed read bandwidth as a horizontal line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(p["name"], part, data) for p in results["presets"]
              for part, data in p["parts"].items()]
    cols = max(1, len({part for _, part, _ in panels}))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, part, data) in zip(axes.flat, panels):
        ts = [p["T"] for p in data["points"]]
        for b in results["config"]["backends"]:
            ax.plot(ts, [p["backends"][b]["gb_s"] for p in data["points"]], marker="o",
                    label=b)
        ax.axhline(data["read_bandwidth"] / 1e9, color="grey", ls="--", lw=0.9,
                   label="read-bandwidth probe")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"{name}: {PART_TITLES[part]}", fontsize=9)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("GB/s read (weights, KV)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
