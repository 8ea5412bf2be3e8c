"""`specmoe study`: when does speculative decoding pay on an MoE model, and why.

One run on this machine:
1. probes memory bandwidth and matmul throughput (`cost_model.MachineProfile`);
2. measures Tt(B, T) on synthetic-weight presets of realistic shape (three MoE sparsities,
   dense with the MoE's active and total parameters; `presets`), MoE routing from a routing
   source (`routing_gen`, by default adjacent-token overlap 0.381), and the draft preset's
   Td(B, 1);
3. fits the cost model on the T = 1 and T = 2 columns (`cost_model.FIT_TOKENS`) and predicts
   every point, next to the Amdahl-style estimate (`cost_model`);
4. captures the learned routing of a real MoE on real prompts (the bundled tiny-moe) and
   analyses its overlap and unique experts against both independence baselines;
5. synthesises S(B, K) from the measured costs and real acceptance lengths (`speedup`);
6. writes report.md, PNG plots and results.json (`study_report`).
"""

from __future__ import annotations

import dataclasses
import gc
import platform
import time

import numpy as np
import torch

from specmoe.analysis import cost_model as cm
from specmoe.analysis.presets import (PRESETS, Preset, check_preset_sizes,
                                      last_level_cache_bytes, preset_size)
from specmoe.analysis.routing_gen import (CorrelatedRouting, TraceRouting, UniformRouting,
                                          expected_unique_experts)
from specmoe.analysis.speedup import speedup_table
from specmoe.analysis.study_config import StudyConfig
from specmoe.analysis.verify_cost import VerifyCostBench, build_synthetic, measure_grid

def routing_source(preset: Preset, cfg: StudyConfig, trace=None):
    """The routing source of a synthetic MoE preset: one shared source, a list of one per
    MoE layer (replaying `trace`), or None (the model's own router). The sources draw over
    all N experts, whatever group limit the preset's router has (DeepSeek's keeps 4 of 8
    groups per token): each expert's chance k/N per token is the same either way, so the
    unique experts of independent tokens, what a forward reads, are too."""
    if cfg.routing == "router":
        return None
    if cfg.routing == "trace":
        base = TraceRouting.from_trace(trace)
        return [base.for_layer(i) for i in range(preset.num_moe_layers)]
    if cfg.routing == "uniform" or preset.num_experts < 2 * preset.top_k:
        return UniformRouting(preset.num_experts, preset.top_k)
    return CorrelatedRouting(preset.num_experts, preset.top_k, cfg.overlap)


def measure_preset(preset: Preset, cfg: StudyConfig, device: str, on_point=None,
                   num_tokens: list[int] | None = None, trace=None) -> dict:
    """Tt(B, T) of one preset over the grid, with the expected unique experts per point."""
    runner = build_synthetic(preset, cfg.dtype, device, cfg.seed)
    source = routing_source(preset, cfg, trace) if preset.is_moe else None
    num_tokens = num_tokens or cfg.num_tokens
    bench = VerifyCostBench(runner, source, cfg.context_len, max(cfg.batch_sizes),
                            max(num_tokens), cfg.seed)
    points = measure_grid(bench, cfg.batch_sizes, num_tokens, cfg.reps, on_point)
    del bench, runner
    gc.collect()
    dtype_bytes = dtype_size(cfg.dtype)
    out = {"preset": dataclasses.asdict(preset), "dtype_bytes": dtype_bytes,
           "size": dataclasses.asdict(preset_size(preset, dtype_bytes)),
           "routing": _routing_json(source, preset),
           "points": [p.to_json() for p in points]}
    if preset.is_moe:
        _add_expected_unique(out, preset, source, cfg)
    return out


def _routing_json(source, preset: Preset) -> dict | None:
    if not preset.is_moe:
        return None
    if source is None:
        return {"name": "router"}
    if isinstance(source, list):
        return {"name": "trace", "num_sequences": len(source[0].sequences)}
    return {"name": source.name, **({"overlap": source.overlap}
                                    if isinstance(source, CorrelatedRouting) else {})}


def _add_expected_unique(out: dict, preset: Preset, source, cfg: StudyConfig) -> None:
    """Each point's expected unique experts (the cost model's input, from the routing source;
    uniform when the model's router routes) next to the uniform closed form."""
    rng = np.random.default_rng(cfg.seed + 1)
    model_source = source or UniformRouting(preset.num_experts, preset.top_k)
    uniform = UniformRouting(preset.num_experts, preset.top_k)
    for p in out["points"]:
        p["expected_unique_experts"] = expected_unique_experts(model_source, p["B"], p["T"], rng)
        p["uniform_unique_experts"] = expected_unique_experts(uniform, p["B"], p["T"], rng)


def measure_draft(cfg: StudyConfig, device: str, on_point=None) -> dict:
    """Td(B, 1) of the draft preset at every B."""
    draft = PRESETS["draft"].scaled(cfg.scale_layers)
    return measure_preset(draft, cfg, device, on_point, num_tokens=[1])


def fit_and_predict(presets: dict[str, dict], machine: cm.MachineProfile,
                    context_len: int) -> dict:
    """Fit the cost model on every preset's points of T in FIT_TOKENS, predict all, add the
    Amdahl estimate; errors are relative to the minimum measured time."""
    rows = []
    for name, res in presets.items():
        shape = cm.ShapeCounts.from_preset(Preset(**res["preset"]), res["dtype_bytes"])
        for p in res["points"]:
            u = p.get("expected_unique_experts", 0.0)
            rows.append((name, shape, p, cm.features(shape, machine, p["B"], p["T"],
                                                     context_len, u)))
    base = [r for r in rows if r[2]["T"] in cm.FIT_TOKENS]
    model = cm.CostModel.fit(np.stack([r[3] for r in base]),
                             np.array([r[2]["min_s"] for r in base]))
    t_one = {(n, p["B"]): p for n, _, p, _ in base if p["T"] == 1}
    for name, shape, p, feats in rows:
        p["predicted_s"] = float(model.predict(feats)[0])
        one = t_one[name, p["B"]]
        p["amdahl_s"] = cm.amdahl_estimate(shape, one["min_s"],
                                           one.get("expected_unique_experts", 1.0),
                                           p.get("expected_unique_experts", 1.0),
                                           p["B"], context_len)
    return {"coefficients": model.to_json(), "errors": _error_summary(presets)}


def _error_summary(presets: dict[str, dict]) -> dict:
    """Median and max relative errors of both models, per preset and overall: every point,
    the verification points (T >= 2), and the points outside the cost model's fit (a scope
    the grid has no point of is left out)."""
    out = {}
    scopes = {"all": lambda p: True, "verification (T>=2)": lambda p: p["T"] >= 2,
              cm.PREDICTED: lambda p: p["T"] not in cm.FIT_TOKENS}
    for scope, keep in scopes.items():
        if not any(keep(p) for res in presets.values() for p in res["points"]):
            continue
        for label, key in (("cost_model", "predicted_s"), ("amdahl", "amdahl_s")):
            per_preset = {}
            for name, res in presets.items():
                pts = [p for p in res["points"] if keep(p)]
                per_preset[name] = cm.relative_errors([p[key] for p in pts],
                                                      [p["min_s"] for p in pts])
            every = np.concatenate(list(per_preset.values()))
            out.setdefault(scope, {})[label] = {
                "median": float(np.median(every)), "max": float(np.max(every)),
                "per_preset_median": {n: float(np.median(e)) for n, e in per_preset.items()}}
    return out


def synthesize(presets: dict[str, dict], draft: dict | None, acceptance: dict[int, float],
               draft_cost_ratio: float | None) -> dict:
    """S(B, K) per preset from measured minimum times (`speedup.speedup_table`)."""
    td = None
    if draft is not None and draft_cost_ratio is None:
        td = {p["B"]: p["min_s"] for p in draft["points"]}
    out = {}
    for name, res in presets.items():
        tt = {(p["B"], p["T"]): p["min_s"] for p in res["points"]}
        out[name] = speedup_table(tt, td, acceptance, draft_cost_ratio)
    return out


def learned_routing(cfg: StudyConfig, trace=None):
    """Overlap, unique experts and load of a real MoE's learned routing: a trace captured
    from `cfg.routing_model` on real prompts (greedy), or read from `cfg.routing_trace`.

    Returns:
        (summary dict for results.json, the `RoutingAnalysis`), or (None, None) when both
        are unset.
    Raises:
        FileNotFoundError: no trace file, model or prompt data.
        ValueError: a bad trace or a dense model.
    """
    from specmoe.analysis.routing_stats import analyze_routing
    from specmoe.analysis.routing_trace import read_trace
    if cfg.routing_trace:
        trace = trace if trace is not None else read_trace(cfg.routing_trace)
        source = f"trace {cfg.routing_trace}"
    elif cfg.routing_model:
        trace, source = _capture_routing(cfg)
    else:
        return None, None
    analysis = analyze_routing(trace)
    return _routing_summary(analysis, source), analysis


def _capture_routing(cfg: StudyConfig):
    from specmoe.analysis.routing_capture import record_routing
    from specmoe.engine.llm_engine import LLM
    from specmoe.sampling_params import SamplingParams
    from specmoe.utils.data import load_prompts
    per_set = -(-cfg.num_routing_prompts // 2)
    prompts = [p.text for ds in ("spec_bench", "mt_bench") for p in load_prompts(ds, per_set)]
    llm = LLM(cfg.routing_model, dtype="float32", seed=cfg.seed)
    params = SamplingParams(max_tokens=cfg.routing_max_tokens, temperature=0.0)
    _, trace = record_routing(llm, prompts[:cfg.num_routing_prompts], params)
    return trace, (f"{cfg.routing_model}, {cfg.num_routing_prompts} Spec-Bench and MT-Bench "
                   f"prompts, {cfg.routing_max_tokens} greedy tokens each")


def _routing_summary(a, source: str) -> dict:
    """The analysis as JSON plus report lines and a one-line finding."""
    w = min(4, len(a.unique_mean))
    pop_overlap = float(np.mean(a.overlap_popularity))
    lines = [f"Source: {source}; N={a.num_experts}, k={a.top_k}, {len(a.moe_layers)} MoE "
             f"layers, {a.num_tokens} tokens analysed.", "",
             "| figure | measured | uniform independent | popularity-weighted independent |",
             "|---|---|---|---|",
             f"| overlap at d=1 | {a.overlap_mean[0]:.3f} | {a.overlap_uniform:.3f} | "
             f"{pop_overlap:.3f} |",
             f"| unique experts, W={w} | {a.unique_mean[w - 1]:.2f} | "
             f"{a.unique_uniform[w - 1]:.2f} | {a.unique_popularity_mean[w - 1]:.2f} |",
             "", f"Expert load imbalance (mean over layers): max/mean "
             f"{np.mean(a.load_max_over_mean):.2f}, coefficient of variation "
             f"{np.mean(a.load_cv):.2f}."]
    if not source.startswith("trace"):
        lines += ["", "Greedy text of a small model repeats itself, which raises the overlap "
                  "at larger distances; the model card measures held-out corpus text."]
    finding = (f"Learned routing ({source.split(',')[0]}): adjacent tokens share "
               f"{a.overlap_mean[0]:.1%} of their experts against {a.overlap_uniform:.1%} "
               f"for independent uniform routing and {pop_overlap:.1%} for independent tokens "
               f"with the measured expert popularity; {w} consecutive tokens touch "
               f"{a.unique_mean[w - 1]:.2f} experts against {a.unique_uniform[w - 1]:.2f} "
               f"(uniform) and {a.unique_popularity_mean[w - 1]:.2f} (popularity).")
    return {"source": source, "analysis": a.to_json(), "summary_lines": lines,
            "finding": finding}


def e2e_check(cfg: StudyConfig, on_step=None) -> dict | None:
    """Predicted vs measured speedup of the real pair end to end (None: skipped)."""
    if not cfg.e2e_model:
        return None
    from specmoe.analysis.e2e_check import E2EConfig, run_e2e_check
    e2e = E2EConfig(cfg.e2e_model, cfg.e2e_draft, cfg.e2e_k, tuple(cfg.e2e_batch_sizes),
                    dtype=cfg.dtype, seed=cfg.seed)
    return run_e2e_check(e2e, on_step)


def machine_json(machine: cm.MachineProfile, device: str) -> dict:
    llc = last_level_cache_bytes()
    return {"device": device, "cpu": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(), "last_level_cache_bytes": llc,
            **machine.to_json()}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name ("bfloat16" -> 2)."""
    return getattr(torch, dtype).itemsize


def size_warnings(presets: list[Preset], cfg: StudyConfig) -> list[str]:
    return check_preset_sizes(presets, last_level_cache_bytes(), dtype_size(cfg.dtype))


def elapsed_since(start: float) -> float:
    return round(time.perf_counter() - start, 1)
