"""`specmoe study`: the command line and the run with a progress bar."""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from specmoe.analysis import study as st
from specmoe.analysis.presets import PRESETS, TARGET_PRESETS
from specmoe.analysis.speedup import parse_acceptance_lengths
from specmoe.analysis.study_report import write_outputs


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: expected ints like "
                                         "1,2,4") from exc


def add_study_parser(sub) -> None:
    p = sub.add_parser("study", help="when does speculation pay on MoE vs dense: measured "
                       "verification cost, cost model, routing analysis, speedup report")
    d = st.StudyConfig()
    p.add_argument("--out", default="study-report", help="report directory")
    p.add_argument("--presets", default=",".join(d.presets),
                   help=f"target presets, from {TARGET_PRESETS}")
    p.add_argument("--batch-sizes", type=_int_list, default=d.batch_sizes)
    p.add_argument("--num-tokens", type=_int_list, default=d.num_tokens,
                   help="T values (tokens per request per forward, K + 1); must include 1")
    p.add_argument("--reps", type=int, default=d.reps)
    p.add_argument("--context-len", type=int, default=d.context_len,
                   help="tokens already in each request's KV cache")
    p.add_argument("--routing", choices=st.ROUTINGS, default=d.routing)
    p.add_argument("--overlap", type=float, default=d.overlap,
                   help="adjacent-token expert overlap of --routing correlated")
    p.add_argument("--scale-layers", type=float, default=d.scale_layers,
                   help="multiply every preset's depth (bigger machines)")
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA if any)")
    p.add_argument("--acceptance-json", default=None,
                   help="a `specmoe bench spec` results.json for AL(K) (default: bundled "
                        "Qwen2.5-Coder pair figures)")
    p.add_argument("--acceptance-group", default=d.acceptance_group)
    p.add_argument("--acceptance", type=parse_acceptance_lengths, default=None,
                   help="AL(K) given directly, e.g. 1=1.8,2=2.4,4=3.3")
    p.add_argument("--draft-cost-ratio", type=float, default=None,
                   help="Td/Tt per draft token (default: measure the draft preset)")
    p.add_argument("--routing-model", default=d.routing_model,
                   help="real MoE whose routing is captured on real prompts ('none': skip)")
    p.add_argument("--routing-trace", default=None, help="analyse this routing-trace JSONL")
    p.add_argument("--e2e-model", default=d.e2e_model,
                   help="real MoE target run end to end against the prediction ('none': skip)")
    p.add_argument("--e2e-draft", default=d.e2e_draft, help="its draft model")
    p.add_argument("--e2e-batch-sizes", type=_int_list, default=d.e2e_batch_sizes)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: one per core; use 1 on busy cores)")


def config_from_args(args) -> st.StudyConfig:
    return st.StudyConfig(
        presets=[x.strip() for x in args.presets.split(",") if x.strip()],
        batch_sizes=args.batch_sizes, num_tokens=args.num_tokens, reps=args.reps,
        context_len=args.context_len, routing=args.routing, overlap=args.overlap,
        scale_layers=args.scale_layers, dtype=args.dtype, device=args.device,
        acceptance_path=args.acceptance_json, acceptance_group=args.acceptance_group,
        acceptance=args.acceptance, draft_cost_ratio=args.draft_cost_ratio,
        routing_model=None if args.routing_model in (None, "none") else args.routing_model,
        routing_trace=args.routing_trace,
        e2e_model=None if args.e2e_model in (None, "none") else args.e2e_model,
        e2e_draft=args.e2e_draft, e2e_batch_sizes=args.e2e_batch_sizes, seed=args.seed)


def cmd_study(args) -> int:
    from specmoe.entrypoints.cli import apply_threads
    apply_threads(args)
    cfg = config_from_args(args)
    console = Console(stderr=True)
    out = st.ensure_dir(args.out)
    results, routing_analysis = run_study(cfg, console)
    write_outputs(results, out, routing_analysis)
    console.print(f"report: {out / 'report.md'}")
    return 0


def print_presets(cfg: st.StudyConfig, console: Console) -> None:
    """Each preset's shape and bytes, before anything is built."""
    from rich.table import Table
    from specmoe.analysis.presets import preset_size
    table = Table(title="presets (synthetic weights)")
    for col in ("preset", "layers", "hidden", "MLP", "total params", "active params", "bytes"):
        table.add_column(col)
    for name in [*cfg.presets, "draft"]:
        p = PRESETS[name].scaled(cfg.scale_layers)
        s = preset_size(p, st.dtype_size(cfg.dtype))
        mlp = (f"{p.num_experts} experts x {p.intermediate_size}, top-{p.top_k}"
               if p.is_moe else f"dense {p.intermediate_size}")
        table.add_row(name, str(p.num_layers), str(p.hidden_size), mlp,
                      f"{s.total_params / 1e6:.0f} M", f"{s.active_params / 1e6:.0f} M",
                      f"{s.weight_bytes / 2**20:.0f} MiB")
    console.print(table)


def run_study(cfg: st.StudyConfig, console: Console):
    """Every step of the study with one progress bar over all timed forwards.

    Returns:
        (results: every figure, JSON-ready; the learned-routing `RoutingAnalysis` or None).
    """
    start = time.perf_counter()
    device = st.resolve_device(cfg.device)
    acceptance, source = st.acceptance_for(cfg)
    print_presets(cfg, console)
    for w in st.size_warnings(cfg):
        console.print(f"[yellow]warning:[/] {w}")
    grid = len(cfg.batch_sizes) * len(cfg.num_tokens) * cfg.reps
    total = grid * len(cfg.presets) + len(cfg.batch_sizes) * cfg.reps * (
        cfg.draft_cost_ratio is None) + 2 * len(cfg.e2e_batch_sizes) * bool(cfg.e2e_model)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn(
            "{task.completed}/{task.total} forwards"), TimeElapsedColumn(),
            console=console) as progress:
        task = progress.add_task("probing the machine", total=total)
        machine = st.cm.MachineProfile.measure(getattr(st.torch, cfg.dtype), device)
        presets = {}
        for name in cfg.presets:
            preset = PRESETS[name].scaled(cfg.scale_layers)
            progress.update(task, description=f"Tt(B, T) of {name}")
            presets[name] = st.measure_preset(preset, cfg, device,
                                              lambda: progress.advance(task))
        draft = None
        if cfg.draft_cost_ratio is None:
            progress.update(task, description="Td(B, 1) of the draft")
            draft = st.measure_draft(cfg, device, lambda: progress.advance(task))
        progress.update(task, description="learned routing")
        learned, routing_analysis = st.learned_routing(cfg)
        progress.update(task, description="end-to-end check")
        e2e = st.e2e_check(cfg, lambda: progress.advance(task))
    fit = st.fit_and_predict(presets, machine, cfg.context_len)
    return {"config": st.dataclasses.asdict(cfg), "machine": st.machine_json(machine, device),
            "presets": presets, "draft": draft, "cost_model": fit,
            "acceptance": {"source": source, "lengths": acceptance},
            "speedup": st.synthesize(presets, draft, acceptance, cfg.draft_cost_ratio),
            "learned_routing": learned, "e2e": e2e, "seconds": st.elapsed_since(start)}, routing_analysis
