"""`specmoe routing analyze TRACE`: adjacent-token expert overlap, unique experts per window
against both independence baselines, and expert load imbalance of a routing trace (JSONL,
docs/routing-trace.md); with --out, also JSON and two PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

JSON_NAME = "routing_analysis.json"
OVERLAP_PNG, UNIQUE_PNG = "overlap_vs_distance.png", "unique_experts_vs_window.png"


def add_routing_parser(sub) -> None:
    """Add `routing analyze` to the `specmoe` subcommands."""
    from specmoe.analysis.routing_trace import PHASES, SEQUENCE_PHASES
    routing = sub.add_parser("routing", help="analyse MoE routing traces")
    routing_sub = routing.add_subparsers(dest="routing_command", required=True)
    p = routing_sub.add_parser(
        "analyze", help="overlap, unique experts vs independence, load imbalance of a trace",
        description=__doc__)
    p.add_argument("trace", metavar="TRACE", help="routing trace (JSONL), e.g. from "
                   "`specmoe generate --routing-trace PATH`")
    p.add_argument("--out", default=None,
                   help=f"directory for {JSON_NAME}, {OVERLAP_PNG} and {UNIQUE_PNG}")
    p.add_argument("--max-distance", type=int, default=8,
                   help="overlap for token distances 1..D (default: %(default)s)")
    p.add_argument("--max-window", type=int, default=8,
                   help="unique experts for windows of 1..W tokens (default: %(default)s)")
    p.add_argument("--phases", default=",".join(SEQUENCE_PHASES),
                   help=f"comma list of the rows to analyse, from {','.join(PHASES)} "
                        "(default: %(default)s, the tokens on the sequence)")


def cmd_routing(args) -> int:
    """Run `specmoe routing analyze`.

    Raises:
        FileNotFoundError: no such trace.
        ValueError: an invalid trace (naming the line and field) or option.
    """
    from specmoe.analysis.routing_stats import analyze_routing
    from specmoe.analysis.routing_trace import read_trace
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if args.out:
        from specmoe.analysis.study_config import prepare_out_dir
        prepare_out_dir(args.out)
    trace = read_trace(args.trace)
    analysis = analyze_routing(trace, args.max_distance, args.max_window, phases)
    print_analysis(analysis, trace.phase_counts(), args.trace)
    if args.out:
        for path in write_analysis(analysis, Path(args.out)):
            print(path)
    return 0


def write_analysis(analysis, out: Path) -> list[Path]:
    """Write the JSON and both plots into `out` (created if needed); returns the paths."""
    from specmoe.analysis.routing_plots import plot_overlap, plot_unique_experts
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / JSON_NAME
    json_path.write_text(json.dumps(analysis.to_json(), indent=1) + "\n")
    return [json_path, plot_overlap(analysis, out / OVERLAP_PNG),
            plot_unique_experts(analysis, out / UNIQUE_PNG)]


def print_analysis(a, phase_counts: dict[str, int], source: str) -> None:
    """Print the analysis as rich tables: overlap by distance, unique experts by window,
    per-layer summary."""
    from rich.console import Console
    console = Console()
    rows = ", ".join(f"{p} {n}" for p, n in phase_counts.items())
    console.print(f"[bold]{source}[/bold]: {a.model or 'model unknown'}, N={a.num_experts} "
                  f"experts, top_k={a.top_k}, {len(a.moe_layers)} MoE layers; rows: {rows}")
    console.print(f"analysed phases {','.join(a.phases)}: {a.num_sequences} sequences, "
                  f"{a.num_tokens} tokens")
    console.print(_overlap_table(a))
    console.print(_unique_table(a))
    console.print(_layer_table(a))


def _overlap_table(a):
    from rich.table import Table
    t = Table(title=f"Overlap |E_t ∩ E_t+d|/k, mean of {len(a.moe_layers)} layers",
              caption="independent tokens: uniform k/N, popularity Σ_e q_e²/k "
                      "(q_e: measured share of tokens routed to e)")
    for col in ("d", "measured", "uniform", "popularity", "pairs"):
        t.add_column(col, justify="right")
    pop = float(a.overlap_popularity.mean())
    for i, d in enumerate(a.distances):
        t.add_row(str(d), _fmt(a.overlap_mean[i], 3), _fmt(a.overlap_uniform, 3),
                  _fmt(pop, 3), str(int(a.num_pairs[i])))
    return t


def _unique_table(a):
    from rich.table import Table
    t = Table(title=f"Unique experts per window of W tokens, mean of {len(a.moe_layers)} "
                    "layers",
              caption="independent tokens: uniform N(1-(1-k/N)^W), "
                      "popularity Σ_e 1-(1-q_e)^W")
    for col in ("W", "measured", "uniform", "popularity", "meas/unif", "meas/pop",
                "windows"):
        t.add_column(col, justify="right")
    for i, w in enumerate(a.windows):
        m, u, p = a.unique_mean[i], a.unique_uniform[i], a.unique_popularity_mean[i]
        t.add_row(str(w), _fmt(m, 2), _fmt(u, 2), _fmt(p, 2), _fmt(m / u, 3),
                  _fmt(m / p, 3), str(int(a.num_windows[i])))
    return t


def _layer_table(a):
    from rich.table import Table
    w = min(4, len(a.windows))
    t = Table(title=f"Per MoE layer (unique experts at W={w} and both baselines)")
    for col in ("layer", "overlap d=1", f"unique W={w}", "uniform", "popularity",
                "load max/mean", "load CV"):
        t.add_column(col, justify="right")
    for i, layer in enumerate(a.moe_layers):
        t.add_row(str(layer), _fmt(a.overlap[0, i], 3), _fmt(a.unique[w - 1, i], 2),
                  _fmt(a.unique_uniform[w - 1], 2), _fmt(a.unique_popularity[w - 1, i], 2),
                  _fmt(a.load_max_over_mean[i], 2), _fmt(a.load_cv[i], 3))
    t.add_row("mean", _fmt(a.overlap_mean[0], 3), _fmt(a.unique_mean[w - 1], 2),
              _fmt(a.unique_uniform[w - 1], 2), _fmt(a.unique_popularity_mean[w - 1], 2),
              _fmt(a.load_max_over_mean.mean(), 2), _fmt(a.load_cv.mean(), 3), style="bold")
    return t


def _fmt(x: float, digits: int) -> str:
    x = float(x)
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def check_trace_path(path: str | None) -> None:
    """Fail before loading a model when `--routing-trace` cannot be written.

    Raises:
        FileNotFoundError: its directory does not exist.
        ValueError: it is a directory.
    """
    if path is None:
        return
    if Path(path).is_dir():
        raise ValueError(f"invalid --routing-trace {path}: a directory, not a file path")
    if not Path(path).resolve().parent.is_dir():
        raise FileNotFoundError(f"invalid --routing-trace {path}: directory "
                                f"{Path(path).resolve().parent} does not exist")


def generate_with_trace(llm, prompt, params, path: str):
    """`llm.generate(prompt, params)[0]`, recording its routing trace to `path` (JSONL).

    Raises:
        ValueError: the model has no MoE layers.
    """
    import sys

    from specmoe.analysis.routing_capture import record_routing
    from specmoe.analysis.routing_trace import write_trace
    outputs, trace = record_routing(llm, prompt, params)
    write_trace(trace, path)
    counts = ", ".join(f"{p} {n}" for p, n in trace.phase_counts().items())
    print(f"--- routing trace: {trace.num_rows} rows ({counts}) -> {path}", file=sys.stderr)
    return outputs[0]
