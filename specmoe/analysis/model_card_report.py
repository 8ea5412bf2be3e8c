"""The model card of `specmoe models card` as Markdown, JSON and one plot (acceptance vs K)."""

from __future__ import annotations

import json
from pathlib import Path

from specmoe.analysis.study_config import PUBLISHED_OVERLAP

# Published routing of a real MoE (docs/architecture.md): 20.36 unique experts in a 4-token
# window against 25.4 for independent tokens.
PUBLISHED_UNIQUE_4 = (20.36, 25.4)
CARD_JSON, CARD_MD, ACCEPTANCE_PNG = "card.json", "README.md", "acceptance_vs_k.png"


def write_card(card: dict, out: str | Path) -> list[Path]:
    """card.json, README.md and acceptance_vs_k.png into `out` (created); returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CARD_JSON).write_text(json.dumps(card, indent=1) + "\n")
    (out / CARD_MD).write_text(render(card))
    return [out / CARD_JSON, out / CARD_MD, plot_acceptance(card, out / ACCEPTANCE_PNG)]


def render(card: dict) -> str:
    cfg = card["config"]
    lines = [f"# Model card: {cfg['model']}", "",
             f"Dense original `{cfg['dense']}`, draft `{cfg['draft']}`, {cfg['dtype']}, every "
             f"figure measured through specmoe's engine ({card['seconds']:.0f} s).", ""]
    lines += _carve_section(card.get("carve"))
    lines += _held_out_section(card["held_out"], cfg)
    lines += _agreement_section(card["greedy_agreement"], card, cfg)
    lines += _acceptance_section(card["acceptance"], card.get("check"), cfg)
    lines += _routing_section(card["routing"])
    return "\n".join(lines) + "\n"


def _carve_section(carve: dict | None) -> list[str]:
    if not carve:
        return ["No carve.json beside the model: not a `specmoe models carve` output.", ""]
    s = carve["settings"]
    n, k, shared = s["num_experts"], s["top_k"], s["shared_experts"]
    layers = carve["layers"]
    secs = sum(r["seconds"] for r in layers)
    errs = [r["error_after"] for r in layers]
    return ["## Carve", "",
            f"From `{carve['source']}`: {n} routed experts, top-{k}, {shared} shared "
            f"(experts' widths), so {(shared + k) / (shared + n):.0%} of the FFN runs per "
            f"token; {len(layers)} layers carved in {secs / 60:.1f} min of layer work "
            f"({s['calibration_windows']} windows of {s['window']} tokens, "
            f"{s['train']['steps']} training steps per layer). Relative error of each layer's "
            f"output on calibration after training: median {sorted(errs)[len(errs) // 2]:.3f}, "
            f"max {max(errs):.3f}.", ""]


def _held_out_section(q: dict, cfg: dict) -> list[str]:
    lines = ["## Held-out perplexity (the corpus split the carve did not see)", "",
             f"{cfg['eval_windows']} windows of {cfg['window']} tokens per file.", "",
             "| text | dense | carved | ratio | argmax = dense | tokens |", "|---|---|---|---|---|---|"]
    for name, r in q.items():
        ratio = r["carved_perplexity"] / r["dense_perplexity"]
        label = "**all**" if name == "all" else name
        lines.append(f"| {label} | {r['dense_perplexity']:.2f} | {r['carved_perplexity']:.2f} | "
                     f"{ratio:.2f}x | {r['argmax_agreement']:.1%} | {r['tokens']} |")
    return lines + [""]


def _agreement_section(g: dict, card: dict, cfg: dict) -> list[str]:
    n = len(card["prompt_groups"])
    return ["## Greedy agreement with the dense model", "",
            f"{n} prompts ({', '.join(sorted(set(card['prompt_groups'])))}), "
            f"{cfg['max_tokens']} greedy tokens each: the carved model's argmax equals the "
            f"dense model's greedy token on {g['teacher_forced_argmax_agreement']:.1%} of "
            f"the dense continuation (teacher forcing); the two greedy outputs share "
            f"{g['shared_prefix_fraction']:.1%} of their tokens before they diverge.", ""]


def _acceptance_section(acc: dict, check: dict | None, cfg: dict) -> list[str]:
    ks = [r["k"] for r in acc["carved"]["draft"]]
    lines = ["## Acceptance (greedy): tokens per target step at K", "",
             "Replayed from the targets' greedy outputs (module docstring of "
             "`specmoe.analysis.model_card`).", "",
             "| proposer | target | " + " | ".join(f"K={k}" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    for proposer in ("draft", "ngram"):
        for target in ("carved", "dense"):
            row = acc[target][proposer]
            lines.append(f"| {cfg['draft'] if proposer == 'draft' else 'n-gram'} | {target} | "
                         + " | ".join(f"{r['tokens_per_step']:.2f}" for r in row) + " |")
    if check:
        lines += ["", f"Check against real speculative runs at K={cfg['check_k']} "
                  "(1 + accepted / drafts, replayed vs measured; lossless = the speculative "
                  "greedy output is the plain one):", ""]
        for target, methods in check.items():
            for method, c in methods.items():
                replayed = acc[target][method][c["k"] - 1]["mean_acceptance_length"]
                lines.append(f"- {target}, {method}: {replayed:.2f} vs "
                             f"{c['mean_acceptance_length']:.2f}, lossless: {c['lossless']}")
    return lines + [""]


def _routing_section(r: dict) -> list[str]:
    u = r["unique_experts"]
    w = len(u["windows"])
    load = list(r["expert_load"]["max_over_mean"].values())
    row = lambda label, vals: f"| {label} | " + " | ".join(f"{v:.1f}" for v in vals) + " |"  # noqa: E731
    return ["## Routing on the prompts", "",
            f"{r['num_tokens']} tokens over {r['num_sequences']} sequences, "
            f"{len(r['moe_layers'])} MoE layers, N={r['num_experts']}, k={r['top_k']}. "
            f"Adjacent-token overlap {r['overlap']['mean'][0]:.3f} (independent tokens: "
            f"{r['overlap']['baseline_uniform']['value']:.3f} uniform, "
            f"{r['overlap']['baseline_popularity']['mean']:.3f} at the measured expert "
            f"popularity; published for a real MoE, k=8 of 128: {PUBLISHED_OVERLAP}).", "",
            "| window W | " + " | ".join(str(x) for x in u["windows"]) + " |",
            "|---|" + "---|" * w,
            row("unique experts", u["mean"]),
            row("independent, uniform", u["baseline_uniform"]["mean"]),
            row("independent, measured popularity", u["baseline_popularity"]["mean"]), "",
            f"Published at W=4: {PUBLISHED_UNIQUE_4[0]} against {PUBLISHED_UNIQUE_4[1]} "
            "independent (k=8 of 128). Expert load per layer, max over mean: median "
            f"{sorted(load)[len(load) // 2]:.2f}, max {max(load):.2f}.", ""]


def plot_acceptance(card: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for proposer, style in (("draft", "-"), ("ngram", "--")):
        for target, marker in (("carved", "o"), ("dense", "s")):
            rows = card["acceptance"][target][proposer]
            ax.plot([r["k"] for r in rows], [r["tokens_per_step"] for r in rows], style,
                    marker=marker, label=f"{proposer} -> {target}")
    ax.set_xlabel("K (draft tokens per step)")
    ax.set_ylabel("tokens per target step")
    ax.set_title(f"Greedy acceptance: {Path(card['config']['model']).name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
