"""Writing `specmoe bench throughput` results: JSON, a Markdown report and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from specmoe.bench.throughput_run import output_len_range


def write_report(results: dict, out_dir: Path) -> list[Path]:
    """results.json, report.md and throughput_vs_concurrency.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(markdown(results))
    paths.append(plot(results, out_dir / "throughput_vs_concurrency.png"))
    return paths


def _weights(cfg: dict, env: dict) -> str:
    """', int4 target weights' (plus the int4 batch-invariant mode when an int4 target ran in
    it), or ''."""
    parts = [f"{q} {who} weights" for who, q in (("target", cfg.get("quantization")),
                                                 ("draft", cfg.get("draft_quantization"))) if q]
    if env.get("int4_batch_invariant") and cfg.get("quantization") == "int4":
        parts.append("int4 batch-invariant mode")
    return "".join(f", {p}" for p in parts)


def markdown(results: dict) -> str:
    cfg, env = results["config"], results["environment"]
    spec = "n-gram" if cfg["draft"] == "ngram" else f"draft {cfg['draft']}"
    pause = cfg.get("spec_disable_by_batch_size")
    policies = cfg.get("policies")
    title = f"# Throughput: {cfg['model']}, plain" + (
        "" if cfg["draft"] == "none" else
        f" vs {spec} under the policies {', '.join(policies)} (K_max "
        f"{cfg['num_speculative_tokens']})" if policies else
        f" vs {spec} (K={cfg['num_speculative_tokens']}"
        + (f", paused from {pause} running requests" if pause else "") + ")")
    lines = [title, "",
             f"{cfg['dtype']}{_weights(cfg, env)}, greedy, {_output_lengths(cfg)} "
             "tokens per request (EOS ignored), "
             f"prompts from {', '.join(cfg['datasets'])} (chat template; lengths "
             f"{_lengths(results['prompts'])} tokens); a run at C < {cfg['num_requests']} "
             f"processes the same {cfg['num_requests']} requests {_arrival(cfg)}, a run at a "
             f"larger C one wave of C; {cfg['reps']} repetitions of the sweep "
             f"{_interleave(cfg)}"
             f"; max_num_batched_tokens "
             f"{cfg['max_num_batched_tokens']}; torch "
             f"threads {env['torch_num_threads']} of {env['cpu_count']} CPUs, load average "
             f"{env['load_average_start']:.1f} -> {env['load_average_end']:.1f}; "
             f"{_bandwidth(env)}{_prefetch(env.get('one_row_prefetch'))}total "
             f"{results['total_seconds'] / 60:.1f} min.", "",
             target_sentence(results["target"]), "",
             *([bound, ""] if (bound := bound_sentence(results)) else []),
             *[line for c in caveats(results) for line in (f"**Caveat**: {c}.", "")],
             *policy_section(results),
             "## Throughput and latency", "", *throughput_table(results), "",
             "Ratios are taken within each repetition and summarised by their median; "
             "latencies run from the submission of a request's wave to its finish, over the "
             "requests of every repetition; TTFT is time to first token.", "",
             "## Engine under load", "", *engine_table(results["rows"]), "",
             "Decode steps carry no prompt tokens; the prefill share is the time in the other "
             "steps. Decode-only tok/s (plain) counts one token per request over the decode "
             "steps, with its ratio to the smallest C: the scaling with prefill set aside. "
             "Of floor: the time the run's matmuls take at the probed peak (nothing else "
             "counted) over its wall time, median of the repetitions: high where the "
             "multiplies bound a run, low where memory reads or overheads do.",
             "",
             *expert_parallel_section(results["rows"], results.get("config", {})),
             "## Slowest steps", "", *slowest_table(results["slowest_steps"])]
    errors = [r for r in results["runs"] if "error" in r]
    if errors:
        lines += ["", "## Errors", ""] + [f"- rep {r['rep']} C={r['concurrency']} "
                                          f"{r['mode']}: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def _bandwidth(env: dict) -> str:
    if "read_bandwidth_start" not in env:  # results from before the probe
        return ""
    return (f"memory read bandwidth {env['read_bandwidth_start'] / 1e9:.0f} -> "
            f"{env['read_bandwidth_end'] / 1e9:.0f} GB/s (single requests are bound by it, "
            "large batches by compute, so the scaling ratios move with it); ")


def _prefetch(state: dict | None) -> str:
    """The one-row panel prefetch setting (`kernels.panel_prefetch`) and, if tuned, why."""
    if state is None:  # results from before the setting
        return ""
    how = (f"tuned: a one-row pass over {state['bytes'] / 1e6:.0f} MB of weights "
           f"{state['off_s'] * 1e3:.1f} ms without, {state['on_s'] * 1e3:.1f} ms with"
           if state["source"] == "tuned" else state["source"])
    return f"one-row weight prefetch {'on' if state['on'] else 'off'} ({how}); "


def caveats(results: dict) -> list[str]:
    """Reasons not to trust the ratios: prompts skipped as too long for the context (the
    prompt mix is not the one asked for), a busy machine (load average before the run plus
    our torch threads above the CPU count), repetitions that disagree by more than 30%."""
    env, out = results["environment"], []
    if skipped := results.get("skipped_prompts"):
        out.append(f"{len(skipped)} of {len(skipped) + len(results['prompts'])} prompts "
                   f"skipped: with {_output_range(results['config'])[1]} output tokens they "
                   f"exceed the context of {results['max_model_len']} tokens (lengths "
                   f"{_lengths(skipped)}); the runs use the {len(results['prompts'])} others")
    busy = env["load_average_start"] + env["torch_num_threads"]
    if busy > env["cpu_count"] + 0.5:
        out.append(f"the machine was busy (load average {env['load_average_start']:.1f} "
                   f"before the run, plus {env['torch_num_threads']} torch threads, on "
                   f"{env['cpu_count']} CPUs); oversubscribed threads slow the small steps "
                   "of low concurrency most, which distorts the scaling ratios: rerun on idle "
                   "cores" + (", or with --threads 1" if env["torch_num_threads"] > 1 else ""))
    noisy = [f"C={r['concurrency']} {r['mode']} "
             f"({r['tokens_per_s_max'] / r['tokens_per_s_min']:.1f}x)"
             for r in results["rows"] if r["num_reps"] > 1
             and r["tokens_per_s_max"] > 1.3 * r["tokens_per_s_min"]]
    if noisy:
        out.append("repetitions disagree by more than 30% (max / min tokens/s) at "
                   + ", ".join(noisy))
    return out


def target_sentence(target: dict) -> str:
    if target["is_met"] is None:
        return f"**Target** ({target['text']}): not evaluated (C=1 or C=" \
               f"{target['concurrency']} was not run)."
    verdict = "MET" if target["is_met"] else "NOT MET"
    line = (f"**Target** ({target['text']}): **{verdict}**: {target['ratio']:.2f}x "
            f"(repetitions {target['ratio_min']:.2f}x-{target['ratio_max']:.2f}x)")
    if target["spec_ratio"] is not None:
        line += f"; with speculation {target['spec_ratio']:.2f}x"
    return line + "."


def bound_sentence(results: dict) -> str:
    """What this machine allows at the target concurrency (`throughput_floor`), or '' for
    results without floors."""
    t, env = results["target"], results["environment"]
    if t.get("ceiling_ratio") is None or "peak_flops" not in env:
        return ""
    c = t["concurrency"]
    row = next((r for r in results["rows"] if r["concurrency"] == c and r["mode"] == "plain"
                and r.get("floor_fraction") is not None), None)
    ran = (f" C={c} plain ran at {100 * row['floor_fraction']:.0f}% of its floor."
           if row else "")
    return (f"**Bound**: at the best multiply rate probed here ({env['peak_flops'] / 1e9:.0f} "
            f"GFLOP/s, {env['peak_source']}), the matmuls of the C={c} run alone (attention, "
            f"memory reads and everything else left out) cap it at "
            f"**{t['ceiling_ratio']:.2f}x** the C=1 rate as measured: the target is "
            f"{100 * t['required_ratio'] / t['ceiling_ratio']:.0f}% of the cap.{ran}")


def throughput_table(results: dict) -> list[str]:
    ratios = results["ratios"]
    base = ratios["baseline_concurrency"]
    out = [f"| C | mode | tok/s median | tok/s min | x plain C={base} | spec / plain | "
           "latency mean (s) | p50 (s) | p90 (s) | TTFT mean (s) | decode tok/s per request |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        c, mode = r["concurrency"], r["mode"]
        if not r["num_reps"]:
            out.append(f"| {c} | {mode} | failed ({r['num_errors']} errors) |" + " |" * 8)
            continue
        scaling = _fmt_ratio(ratios["scaling"].get(mode, {}).get(str(c)))
        speedup = _fmt_ratio(ratios.get("speedup_by_mode", {}).get(mode, {}).get(str(c))) \
            if mode != "plain" else ""
        out.append(f"| {c} | {mode} | {r['tokens_per_s_median']:.2f} | "
                   f"{r['tokens_per_s_min']:.2f} | {scaling} | {speedup} | "
                   f"{r['latency_mean_s']:.2f} | {r['latency_p50_s']:.2f} | "
                   f"{r['latency_p90_s']:.2f} | {r['first_token_mean_s']:.2f} | "
                   f"{r['decode_tokens_per_s_mean']:.2f} |")
    return out


def policy_section(results: dict) -> list[str]:
    """With several speculative modes: speedup over plain per C and mode, the adaptive
    policy's K choices, and the issue's targets, over whole runs and over the steps at
    full occupancy (`throughput_stats.full_batch_tokens_per_s`; empty with one mode)."""
    ratios = results["ratios"]
    by_mode = ratios.get("speedup_by_mode", {})
    if len(by_mode) < 2:
        return []
    rows = {(r["concurrency"], r["mode"]): r for r in results["rows"] if r["num_reps"]}
    out = ["## Speculation policies", "",
           "Speculative tokens/s over plain tokens/s at the same C (median of the per-"
           "repetition ratios); for adaptive modes, the mean K and share of (request, step) "
           "pairs at K = 0.", ""]
    out += _policy_table(by_mode, rows, ratios.get("policy_targets"))
    errors = [r["step_time_prediction_error"] for r in rows.values()
              if r.get("step_time_prediction_error") is not None]
    if errors:
        out.append(f"Median relative error of the adaptive policy's predicted step "
                   f"times: {min(errors):.1%} to {max(errors):.1%} over the runs' C.")
    full = ratios.get("full_batch_speedup_by_mode")
    if full:
        out += ["", "### At full occupancy", "",
                "The same ratios over the steps whose batch held min(C, requests) requests, "
                "as a server with requests waiting runs: a finite run ends in a drain below "
                "C, longer where speculation staggers when requests finish (the engine table's "
                "batch mean).", ""]
        out += _policy_table(full, rows, ratios.get("full_batch_policy_targets"))
    return out + [""]


def _policy_table(by_mode: dict, rows: dict, targets: dict | None) -> list[str]:
    """The speedup table of `policy_section` and its targets line."""
    modes = list(by_mode)
    cs = sorted({int(c) for v in by_mode.values() for c in v})
    adaptive = [m for m in modes if m.startswith("adaptive")]
    out = ["| C | " + " | ".join(modes) + "".join(f" | {m} K mean / off" for m in adaptive)
           + " |", "|---" * (len(modes) + len(adaptive) + 1) + "|"]
    for c in cs:
        ks = []
        for m in adaptive:
            a = rows.get((c, m), {})
            ks.append(f"{a['draft_k_mean']:.2f} / {100 * a['draft_k_zero_share']:.0f}%"
                      if a.get("draft_k_mean") is not None else "")
        out.append(f"| {c} | " + " | ".join(_fmt_ratio(by_mode[m].get(str(c)))
                                             for m in modes)
                   + "".join(f" | {k}" for k in ks) + " |")
    if targets:
        t = targets
        out += ["", f"Targets: adaptive >= 0.97x plain at every C (worst "
                f"{t['min_vs_plain']:.2f}x) and >= 0.95x the best static K at every C "
                f"(worst {t['min_vs_best_static']:.2f}x): "
                f"{'met' if t['met'] else 'NOT met'}. Adaptive over the best static K per C: "
                + ", ".join(f"C={c} {v['vs_best_static']:.2f}x ({v['best_static']})"
                            for c, v in t["per_concurrency"].items()
                            if v["vs_best_static"] is not None) + "."]
        out += _aa_line(t)
    return out


def _aa_line(targets: dict) -> list[str]:
    """The A/A control's band per C and the misses of 0.97x plain inside it (none without
    the control)."""
    bands = {c: v["aa"] for c, v in targets["per_concurrency"].items() if v.get("aa")
             and v["aa"]["min"] is not None}
    if not bands:
        return []
    within = targets.get("misses_within_aa") or []
    return ["", "A/A control (a second engine without speculation over plain, min-max of "
            "the repetitions): " + ", ".join(f"C={c} {b['min']:.2f}-{b['max']:.2f}x"
                                             for c, b in bands.items())
            + ". Adaptive's misses of 0.97x plain within that band: "
            + (", ".join(f"C={c}" for c in within) if within else "none") + "."]


def engine_table(rows: list[dict]) -> list[str]:
    out = ["| C | mode | steps | batch mean | batch max | preemptions | KV blocks peak | "
           "prefix-cache hits | prefill share of time | decode step median (ms) | "
           "step max (ms) | decode-only tok/s | acceptance length | acceptance rate | "
           "speculation paused | of floor |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["num_reps"]:
            continue
        out.append(f"| {r['concurrency']} | {r['mode']} | {r['num_steps_mean']:.0f} | "
                   f"{r['mean_batch_size']:.1f} | {r['max_batch_size']} | "
                   f"{r['num_preemptions']} | {r['max_kv_blocks_used']} | "
                   f"{100 * r.get('prefix_cache_hit_rate', 0.0):.0f}% | "
                   f"{100 * r.get('prefill_time_share', 0.0):.0f}% | "
                   f"{1e3 * r.get('decode_step_seconds_median', float('nan')):.0f} | "
                   f"{1e3 * r['step_seconds_max']:.0f} | {_decode_only(r)} | "
                   f"{r['mean_acceptance_length']:.2f} | {r['acceptance_rate']:.2f} | "
                   f"{_paused(r)} | {_percent(r.get('floor_fraction'))} |")
    return out


# What the MoE layers' collectives are, by expert-parallel dispatch.
COMBINES = {"replicated": "the MoE layers' all-reduce of partial expert outputs",
            "all_to_all": "the MoE layers' all-to-all of each rank's token slice out and "
                          "back and the all-gather of the slices' outputs"}


def expert_parallel_section(rows: list[dict], config: dict | None = None) -> list[str]:
    """Communication under expert parallelism ([] without it), with the run's dispatch and
    placement (the bench config's expert_parallel_dispatch and expert_placement)."""
    rows = [r for r in rows if "communication_share" in r]
    if not rows:
        return []
    config = config or {}
    dispatch = config.get("expert_parallel_dispatch", "replicated")
    combine = COMBINES.get(dispatch, dispatch)
    out = ["## Expert parallelism", "",
           f"Dispatch `{dispatch}`, placement `{config.get('expert_placement', 'contiguous')}`.",
           "",
           "| C | mode | communication share of forward time | collective KiB per forward | "
           "(token, slot) pairs per rank |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['concurrency']} | {r['mode']} | "
                   f"{100 * r['communication_share']:.0f}% | "
                   f"{r['collective_bytes_per_forward'] / 1024:.0f} | "
                   f"{' / '.join(str(n) for n in r['rank_load'])} |")
    return out + ["", "Communication: rank 0 broadcasting each batch to the other ranks "
                  f"and {combine}, over rank 0's forward wall time (waits for the slowest "
                  "rank included).", ""]


def _percent(fraction: float | None) -> str:
    return "" if fraction is None else f"{100 * fraction:.0f}%"


def _paused(row: dict) -> str:
    """Share of steps after which speculation paused (disable_by_batch_size)."""
    share = row.get("spec_paused_step_share", 0.0)
    return f"{100 * share:.0f}% of steps" if row["mode"] != "plain" and share else ""


def slowest_table(steps: list[dict]) -> list[str]:
    out = ["| ms | C | mode | rep | step | batch | tokens | drafts | preempted |",
           "|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        out.append(f"| {1e3 * s['seconds']:.0f} | {s['concurrency']} | {s['mode']} | "
                   f"{s['rep'] + 1} | {s['step_index']} | {s['num_scheduled_requests']} | "
                   f"{s['num_scheduled_tokens']} | {s['num_draft_tokens']} | "
                   f"{s['num_preempted']} |")
    return out


def _decode_only(row: dict) -> str:
    tps = row.get("decode_only_tokens_per_s")
    if tps is None:
        return ""
    scaling = row.get("decode_only_scaling")
    return f"{tps:.1f}" + (f" ({scaling:.2f}x)" if scaling is not None else "")


def _output_range(cfg: dict) -> tuple[int, int]:
    """The least and most tokens a request generated (results before the range ratio have
    none: every request max_tokens)."""
    return output_len_range(cfg["max_tokens"], cfg.get("max_tokens_range_ratio", 0.0))


def _output_lengths(cfg: dict) -> str:
    """The output length, or its range (`max_tokens_range_ratio`)."""
    lo, hi = _output_range(cfg)
    return (str(lo) if lo == hi else
            f"{lo}-{hi} (uniform, a prompt's the same in every mode)")


def _lengths(prompts: list[dict]) -> str:
    lengths = sorted(p["num_tokens"] for p in prompts)
    return f"{lengths[0]}-{lengths[-1]}, median {lengths[len(lengths) // 2]}"


def _fmt_ratio(summary: dict | None) -> str:
    if not summary or summary["median"] is None:
        return "-"
    return f"{summary['median']:.2f}x"


def plot(results: dict, path: Path) -> Path:
    """Left: tokens/s against concurrency per mode (median, min as a lower mark), with
    linear scaling from plain C=1 and the target point; right: speculative / plain."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in results["rows"] if r["num_reps"]]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = [(r["concurrency"], r["tokens_per_s_median"], r["tokens_per_s_min"])
               for r in rows if r["mode"] == mode]
        if pts:
            cs, med, low = zip(*pts)
            line, = ax.plot(cs, med, marker="o", label=f"{mode} (median)")
            ax.scatter(cs, low, marker="_", color=line.get_color(), label=f"{mode} (min)")
    base = next((r for r in rows if r["mode"] == "plain"
                 and r["concurrency"] == results["ratios"]["baseline_concurrency"]), None)
    if base is not None:
        cs = sorted({r["concurrency"] for r in rows})
        ax.plot(cs, [base["tokens_per_s_median"] * c / base["concurrency"] for c in cs],
                color="grey", ls=":", lw=0.8, label="linear scaling")
    t = results["target"]
    if base is not None and base["concurrency"] == 1:
        ax.scatter([t["concurrency"]], [t["required_ratio"] * base["tokens_per_s_median"]],
                   marker="*", s=120, color="red", zorder=3,
                   label=f"target {t['required_ratio']:g}x at C={t['concurrency']}")
    _concurrency_axis(ax, rows)
    _log_y(ax)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("total output tokens/s")
    ax.legend(fontsize=7)
    by_mode = results["ratios"].get("speedup_by_mode") or {"spec": results["ratios"]["speedup"]}
    for i, (mode, ratios) in enumerate(by_mode.items()):
        speed = sorted((int(c), s["median"]) for c, s in ratios.items()
                       if s["median"] is not None)
        if speed:
            ax2.plot(*zip(*speed), marker="o", color=f"C{i + 1}", label=mode)
    if len(by_mode) > 1:
        ax2.legend(fontsize=7)
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    _concurrency_axis(ax2, rows)
    ax2.set_xlabel("concurrent requests")
    ax2.set_ylabel("speculative / plain tokens/s")
    fig.suptitle(results["config"]["model"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _concurrency_axis(ax, rows: list[dict]) -> None:
    """Log2 x axis labelled with the concurrencies that were run."""
    cs = sorted({r["concurrency"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.minorticks_off()


def _log_y(ax) -> None:
    """Log y axis with ticks at 1, 2, 5 x 10^n labelled as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _arrival(cfg: dict) -> str:
    if cfg.get("arrival", "waves") == "closed":
        return "C at a time (each submitted as one finishes)"
    return "in waves of C"


def _order(cfg: dict, each: str = "turn") -> str:
    """How the modes' order changed from turn to turn (results saved before the balanced
    orders reversed it every other turn)."""
    if cfg.get("mode_order") == "balanced":
        return (f"in a balanced order each {each}: every mode after every other one equally "
                "often")
    return f"their order reversed every other {each}"


def _interleave(cfg: dict) -> str:
    """How the report's modes alternated (configs saved before `interleave` ran whole runs)."""
    if cfg["draft"] == "none":
        return "(plain only)"
    interleave = cfg.get("interleave", "run")
    if interleave == "slice":
        return (f"(at each C the modes' runs take turns of {cfg['slice_seconds']} s of "
                f"stepping, {_order(cfg)})")
    if interleave == "wave":
        if cfg.get("arrival", "waves") == "closed":
            return f"(at each C the modes' runs alternate, {_order(cfg, 'repetition')})"
        return "(at each C the modes alternate wave by wave)"
    return "(plain then speculative at each C)"
