"""`specmoe study`: the command line and the run with a progress bar."""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from specmoe.analysis import study as st
from specmoe.analysis.presets import PRESETS, TARGET_PRESETS, Preset
from specmoe.analysis.speedup import parse_acceptance_lengths
from specmoe.analysis.study_config import (ROUTINGS, StudyConfig, StudyPlan, plan_study,
                                           prepare_out_dir)
from specmoe.analysis.study_report import write_outputs
from specmoe.entrypoints.args import apply_threads, comma_list


def _acceptance_arg(text: str) -> dict[int, float]:
    try:
        return parse_acceptance_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_study_parser(sub) -> None:
    p = sub.add_parser("study", help="when does speculation pay on MoE vs dense: measured "
                       "verification cost, cost model, routing analysis, speedup report")
    d = StudyConfig()
    p.add_argument("--out", default="study-report",
                   help="report directory, created if missing (default: %(default)s)")
    p.add_argument("--presets", type=comma_list(), default=",".join(d.presets),
                   help=f"target presets, from {TARGET_PRESETS}")
    p.add_argument("--batch-sizes", type=comma_list(int), default=d.batch_sizes,
                   help="B values, ascending (default: 1,2,4,8,16,32,64)")
    p.add_argument("--num-tokens", type=comma_list(int), default=d.num_tokens,
                   help="T values (tokens per request per forward, K + 1); must include 1")
    p.add_argument("--reps", type=int, default=d.reps,
                   help="repetitions of every grid point; min and median are reported "
                        "(default: %(default)s)")
    p.add_argument("--context-len", type=int, default=d.context_len,
                   help="tokens already in each request's KV cache")
    p.add_argument("--routing", choices=ROUTINGS, default=d.routing)
    p.add_argument("--overlap", type=float, default=d.overlap,
                   help="adjacent-token expert overlap of --routing correlated")
    p.add_argument("--scale-layers", type=float, default=d.scale_layers,
                   help="multiply every preset's depth (bigger machines)")
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA if any)")
    p.add_argument("--acceptance-json", default=None,
                   help="a `specmoe bench spec` results.json for AL(K) (default: bundled "
                        "Qwen2.5-Coder pair figures)")
    p.add_argument("--acceptance-group", default=d.acceptance_group,
                   help="data-set group of the AL figures: all, humaneval, mt_bench, gsm8k "
                        "or spec_bench/<category> (default: %(default)s)")
    p.add_argument("--acceptance", type=_acceptance_arg, default=None,
                   help="AL(K) given directly, e.g. 1=1.8,2=2.4,4=3.3")
    p.add_argument("--draft-cost-ratio", type=float, default=None,
                   help="Td/Tt per draft token (default: measure the draft preset)")
    p.add_argument("--routing-model", default=d.routing_model,
                   help="real MoE whose routing is captured on real prompts ('none': skip)")
    p.add_argument("--routing-trace", default=None, help="analyse this routing-trace JSONL")
    p.add_argument("--e2e-model", default=d.e2e_model,
                   help="real MoE target run end to end against the prediction ('none': skip)")
    p.add_argument("--e2e-draft", default=d.e2e_draft, help="its draft model")
    p.add_argument("--e2e-batch-sizes", type=comma_list(int), default=d.e2e_batch_sizes)
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seeds weights, token ids and routing draws (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: one per core; use 1 on busy cores)")


def config_from_args(args) -> StudyConfig:
    return StudyConfig(
        presets=args.presets,
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
    apply_threads(args)
    cfg = config_from_args(args)
    plan = plan_study(cfg)
    out = prepare_out_dir(args.out)
    console = Console(stderr=True)
    results, routing_analysis = run_study(cfg, plan, console)
    write_outputs(results, out, routing_analysis)
    console.print(f"report: {out / 'report.md'}")
    return 0


def print_presets(presets: list[Preset], cfg: StudyConfig, console: Console) -> None:
    """Each preset's shape and bytes, before anything is built."""
    from rich.table import Table
    from specmoe.analysis.presets import preset_size
    table = Table(title="presets (synthetic weights)")
    for col in ("preset", "layers", "hidden", "MLP", "total params", "active params", "bytes"):
        table.add_column(col)
    for p in [*presets, PRESETS["draft"].scaled(cfg.scale_layers)]:
        s = preset_size(p, st.dtype_size(cfg.dtype))
        mlp = (f"{p.num_experts} experts x {p.intermediate_size}, top-{p.top_k}"
               if p.is_moe else f"dense {p.intermediate_size}")
        table.add_row(p.name, str(p.num_layers), str(p.hidden_size), mlp,
                      f"{s.total_params / 1e6:.0f} M", f"{s.active_params / 1e6:.0f} M",
                      f"{s.weight_bytes / 2**20:.0f} MiB")
    console.print(table)


def _num_forwards(cfg: StudyConfig, plan: StudyPlan) -> int:
    grid = len(cfg.batch_sizes) * len(cfg.num_tokens) * cfg.reps
    draft = len(cfg.batch_sizes) * cfg.reps * (cfg.draft_cost_ratio is None)
    return grid * len(plan.presets) + draft + 2 * len(cfg.e2e_batch_sizes) * bool(cfg.e2e_model)


def run_study(cfg: StudyConfig, plan: StudyPlan, console: Console):
    """Every step of the study with one progress bar over all timed forwards.

    Returns:
        (results: every figure, JSON-ready; the learned-routing `RoutingAnalysis` or None).
    """
    start = time.perf_counter()
    print_presets(plan.presets, cfg, console)
    warnings = plan.warnings + st.size_warnings(plan.presets, cfg)
    for w in warnings:
        console.print(f"[yellow]warning:[/] {w}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn(
            "{task.completed}/{task.total} forwards"), TimeElapsedColumn(),
            console=console) as progress:
        task = progress.add_task("probing the machine", total=_num_forwards(cfg, plan))
        step = lambda: progress.advance(task)  # noqa: E731
        machine = st.cm.MachineProfile.measure(getattr(st.torch, cfg.dtype), plan.device)
        presets = {}
        for preset in plan.presets:
            progress.update(task, description=f"Tt(B, T) of {preset.name}")
            presets[preset.name] = st.measure_preset(preset, cfg, plan.device, step,
                                                     trace=plan.trace)
        draft = None
        if cfg.draft_cost_ratio is None:
            progress.update(task, description="Td(B, 1) of the draft")
            draft = st.measure_draft(cfg, plan.device, step)
        learned = routing_analysis = e2e = None
        if cfg.routing_trace or cfg.routing_model:
            progress.update(task, description="learned routing")
            learned, routing_analysis = st.learned_routing(cfg, plan.trace)
        if cfg.e2e_model:
            progress.update(task, description="end-to-end check")
            e2e = st.e2e_check(cfg, step)
    fit = st.fit_and_predict(presets, machine, cfg.context_len)
    return {"config": st.dataclasses.asdict(cfg), "machine": st.machine_json(machine, plan.device),
            "presets": presets, "draft": draft, "cost_model": fit, "warnings": warnings,
            "acceptance": {"source": plan.acceptance_source, "lengths": plan.acceptance},
            "speedup": st.synthesize(presets, draft, plan.acceptance, cfg.draft_cost_ratio),
            "learned_routing": learned, "e2e": e2e,
            "seconds": st.elapsed_since(start)}, routing_analysis
