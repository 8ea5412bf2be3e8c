"""`specmoe study`: the command line and the run with a progress bar."""

from __future__ import annotations

import argparse
import dataclasses
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from specmoe.analysis import study as st
from specmoe.analysis.presets import PRESETS, TARGET_PRESETS, Preset
from specmoe.analysis.speedup import parse_acceptance_lengths
from specmoe.analysis.study_config import (ROUTINGS, StudyConfig, StudyPlan, plan_study,
                                           prepare_out_dir)
from specmoe.analysis.study_findings import findings, measurement_warnings
from specmoe.analysis.study_report import write_outputs
from specmoe.entrypoints.args import apply_threads, comma_list, fresh_out_dir


def _acceptance_arg(text: str) -> dict[int, float]:
    try:
        return parse_acceptance_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


# `--quick`: one MoE against the dense model of its total size, three batch sizes, K = 1,
# 3, 4 (the bundled acceptance lengths cover them), half-depth presets, one repetition.
QUICK = {"presets": ["moe-128x8", "dense-total"], "batch_sizes": [1, 4, 16],
         "num_tokens": [1, 2, 4, 5], "reps": 1, "context_len": 128, "scale_layers": 0.5,
         "e2e_batch_sizes": [1, 4]}


def add_study_parser(sub) -> None:
    p = sub.add_parser("study", help="when does speculation pay on MoE vs dense: measured "
                       "verification cost, cost model, routing analysis, speedup report")
    d = StudyConfig()
    p.add_argument("--out", default=None,
                   help="report directory, created if missing (default: "
                        "out/study-DATE-TIME)")
    p.add_argument("--quick", action="store_true",
                   help="a first look in a few minutes: " + ", ".join(
                       f"--{k.replace('_', '-')} {_show(v)}" for k, v in QUICK.items())
                   + " (options given explicitly still apply)")
    p.add_argument("--presets", type=comma_list(), default=None,
                   help=f"target presets, from {TARGET_PRESETS} (default: all)")
    p.add_argument("--batch-sizes", type=comma_list(int), default=None,
                   help=f"B values, ascending (default: {_show(d.batch_sizes)})")
    p.add_argument("--num-tokens", type=comma_list(int), default=None,
                   help="T values (tokens per request per forward, K + 1); must include 1 "
                        f"(default: {_show(d.num_tokens)})")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions of every grid point; min and median are reported "
                        f"(default: {d.reps})")
    p.add_argument("--context-len", type=int, default=None,
                   help=f"tokens already in each request's KV cache (default: {d.context_len})")
    p.add_argument("--routing", choices=ROUTINGS, default=d.routing)
    p.add_argument("--overlap", type=float, default=d.overlap,
                   help="adjacent-token expert overlap of --routing correlated")
    p.add_argument("--scale-layers", type=float, default=None,
                   help=f"multiply every preset's depth (bigger machines; default: "
                        f"{d.scale_layers})")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights and activations; auto (default): bfloat16 where specmoe's "
                        "native CPU kernels run, float32 elsewhere (as the engine decodes)")
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
    p.add_argument("--e2e-batch-sizes", type=comma_list(int), default=None,
                   help=f"(default: {_show(d.e2e_batch_sizes)})")
    real = p.add_argument_group(
        "real models", "--models switches the study from synthetic presets to real models: "
        "Tt(B, T) on real text and end-to-end speedups through the batched engine, MoE and "
        "dense side by side (defaults: " + ", ".join(
            f"--{k.replace('_', '-')} {_show(v)}" for k, v in _real_defaults().items()) + ")")
    real.add_argument("--models", type=comma_list(), default=None,
                      help="real target models, e.g. qwen2.5-coder-1.5b-moe,qwen2.5-coder-1.5b")
    real.add_argument("--reanalyse", default=None, metavar="RESULTS_JSON",
                      help="measure nothing: refit the cost model on a saved real-model "
                           "study's results.json and rewrite its report in --out")
    real.add_argument("--draft", default=None, help="the draft paired with every target")
    real.add_argument("--ks", type=comma_list(int), default=None,
                      help="K of the end-to-end speculative runs")
    real.add_argument("--e2e-reps", type=int, default=None,
                      help="repetitions of every end-to-end run (median)")
    real.add_argument("--max-tokens", type=int, default=None,
                      help="greedy tokens per request end to end")
    real.add_argument("--prompt-tokens", type=int, default=None,
                      help="end-to-end questions cut to this many tokens (inside the chat "
                           "template)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seeds weights, token ids and routing draws (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: one per core; use 1 on busy cores)")


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _grid(args, name: str):
    """An option as given, else its --quick value under --quick, else StudyConfig's."""
    given = getattr(args, name)
    if given is not None:
        return given
    if args.quick and name in QUICK:
        return QUICK[name]
    return getattr(StudyConfig(), name)


def config_from_args(args) -> StudyConfig:
    from specmoe.loader.model_loader import resolve_dtype
    return StudyConfig(
        presets=_grid(args, "presets"), batch_sizes=_grid(args, "batch_sizes"),
        num_tokens=_grid(args, "num_tokens"), reps=_grid(args, "reps"),
        context_len=_grid(args, "context_len"), routing=args.routing, overlap=args.overlap,
        scale_layers=_grid(args, "scale_layers"),
        dtype=resolve_dtype(args.dtype, args.device), device=args.device,
        acceptance_path=args.acceptance_json, acceptance_group=args.acceptance_group,
        acceptance=args.acceptance, draft_cost_ratio=args.draft_cost_ratio,
        routing_model=None if args.routing_model in (None, "none") else args.routing_model,
        routing_trace=args.routing_trace,
        e2e_model=None if args.e2e_model in (None, "none") else args.e2e_model,
        e2e_draft=args.e2e_draft, e2e_batch_sizes=_grid(args, "e2e_batch_sizes"),
        seed=args.seed)


def _real_defaults() -> dict:
    from specmoe.analysis.real_study import RealStudyConfig
    d = RealStudyConfig()
    return {k: getattr(d, k) for k in ("draft", "batch_sizes", "num_tokens", "e2e_batch_sizes",
                                       "ks", "reps", "e2e_reps", "context_len", "max_tokens",
                                       "prompt_tokens")}


def real_config_from_args(args):
    """The real-model study's settings: options given, else `RealStudyConfig`'s defaults.

    Raises:
        ValueError: inconsistent grids (`RealStudyConfig`).
    """
    from specmoe.analysis.real_study import RealStudyConfig
    from specmoe.loader.model_loader import resolve_dtype
    given = {k: getattr(args, k) for k in _real_defaults() if getattr(args, k) is not None}
    return RealStudyConfig(models=args.models, dtype=resolve_dtype(args.dtype, args.device),
                           seed=args.seed, **given)


def cmd_real_study(args) -> int:
    from specmoe.analysis.real_study import run_real_study
    from specmoe.analysis.real_study_report import write_real_outputs
    cfg = real_config_from_args(args)
    out = prepare_out_dir(args.out or fresh_out_dir("study"))
    console = Console(stderr=True)
    results = run_real_study(cfg, lambda msg: console.print(f"[bold]{msg}[/]"))
    write_real_outputs(results, out)
    console.print(f"report: {out / 'report.md'}")
    return 0


def cmd_reanalyse(args) -> int:
    """The real-model study's analysis and report from a saved results.json.

    Raises:
        ValueError: the file is not a real-model study's results.json.
    """
    import json
    from pathlib import Path

    from specmoe.analysis.real_study import analyse
    from specmoe.analysis.real_study_report import write_real_outputs
    results = json.loads(Path(args.reanalyse).read_text())
    if not isinstance(results, dict) or not {"targets", "machine", "config"} <= set(results):
        raise ValueError(f"--reanalyse {args.reanalyse}: not the results.json of a "
                         "real-model study (specmoe study --models ...)")
    results["analysis"] = analyse(results, st.cm.MachineProfile.from_json(results["machine"]))
    out = prepare_out_dir(args.out or fresh_out_dir("study"))
    write_real_outputs(results, out)
    Console(stderr=True).print(f"report: {out / 'report.md'}")
    return 0


def cmd_study(args) -> int:
    apply_threads(args)
    if args.reanalyse:
        return cmd_reanalyse(args)
    if args.models:
        return cmd_real_study(args)
    cfg = config_from_args(args)
    plan = plan_study(cfg)
    out = prepare_out_dir(args.out or fresh_out_dir("study"))
    console = Console(stderr=True)
    results, routing_analysis = run_study(cfg, plan, console)
    write_outputs(results, out, routing_analysis)
    console.print("[bold]findings[/]")
    for line in findings(results):
        console.print(line, markup=False)
    console.print(f"report: {out / 'report.md'}")
    return 0


def print_presets(presets: list[Preset], cfg: StudyConfig, console: Console) -> None:
    """Each preset's shape and bytes, before anything is built."""
    from rich.table import Table
    from specmoe.analysis.presets import preset_size
    from specmoe.analysis.study_findings import shape_extras
    table = Table(title="presets (synthetic weights)")
    for col in ("preset", "layers", "hidden", "MLP", "total params", "active params", "bytes"):
        table.add_column(col)
    for p in [*presets, PRESETS["draft"].scaled(cfg.scale_layers)]:
        s = preset_size(p, st.dtype_size(cfg.dtype))
        mlp = (f"{p.num_experts} experts x {p.intermediate_size}, top-{p.top_k}"
               if p.is_moe else f"dense {p.intermediate_size}")
        mlp += "".join(f", {x}" for x in shape_extras(dataclasses.asdict(p)))
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
    for w in measurement_warnings(presets, fit):
        console.print(f"[yellow]warning:[/] {w}")
        warnings.append(w)
    return {"config": st.dataclasses.asdict(cfg), "machine": st.machine_json(machine, plan.device),
            "presets": presets, "draft": draft, "cost_model": fit, "warnings": warnings,
            "acceptance": {"source": plan.acceptance_source, "lengths": plan.acceptance},
            "speedup": st.synthesize(presets, draft, plan.acceptance, cfg.draft_cost_ratio),
            "learned_routing": learned, "e2e": e2e,
            "seconds": st.elapsed_since(start)}, routing_analysis
