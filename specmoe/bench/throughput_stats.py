"""The figures of a `specmoe bench throughput` run, from its raw runs (pure functions): one
row per (concurrency, mode), the ratios paired within repetitions, the speculation
policies' targets, the issue's target line and the slowest steps."""

from __future__ import annotations

import statistics

import numpy as np

from specmoe.bench import throughput_ep

AA_MODE = "plain2"  # the A/A control's mode (`ThroughputBenchConfig.aa_control`)

# one engine step of a run: its wall seconds and the scheduler's counts
STEP_FIELDS = ["seconds", "num_scheduled_requests", "num_scheduled_tokens",
               "num_draft_tokens", "num_preempted", "num_logits", "num_emitted_tokens"]

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics
    (`numpy.percentile`); NaN for no values."""
    return float(np.percentile(values, q)) if values else float("nan")


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (concurrency, mode) over its repetitions: tokens/s (each, min, median),
    latency (mean, p50, p90 over every request of every repetition), mean time to first
    token, mean per-request decode tokens/s, engine counters, acceptance statistics, step
    times, the share of step time in steps that carry prompt tokens, and (plain only)
    decode-only tokens/s over the steps without prompt tokens, with its ratio to the
    smallest C's (decode_only_scaling). Runs with an error only count in num_errors."""
    keyed: dict[tuple, list[dict]] = {}
    for r in runs:
        keyed.setdefault((r["concurrency"], r["mode"]), []).append(r)
    order = list(dict.fromkeys(r["mode"] for r in runs))
    rows = [_row(c, mode, rs) for (c, mode), rs in sorted(
        keyed.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1])))]
    base = next((r.get("decode_only_tokens_per_s") for r in rows if r["mode"] == "plain"), None)
    for r in rows:
        if base and r.get("decode_only_tokens_per_s"):
            r["decode_only_scaling"] = r["decode_only_tokens_per_s"] / base
    return rows


def _row(concurrency: int, mode: str, runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    row = {"concurrency": concurrency, "mode": mode, "num_reps": len(ok),
           "num_errors": len(runs) - len(ok)}
    if not ok:
        return row
    tps = [r["tokens_per_s"] for r in ok]
    reqs = [q for r in ok for q in r["requests"]]
    lat = [q["latency_s"] for q in reqs]
    stats = [r["engine_stats"] for r in ok]
    spec = [s["spec_decode"] for s in stats]
    drafts = sum(s["num_drafts"] for s in spec)
    drafted = sum(s["num_draft_tokens"] for s in spec)
    accepted = sum(s["num_accepted_tokens"] for s in spec)
    step_s = [s[0] for r in ok for s in r["steps"]]
    decode = [s for r in ok for s in r["steps"] if is_decode_step(s)]
    decode_s = sum(s[0] for s in decode)
    return row | {
        "tokens_per_s": tps, "tokens_per_s_min": min(tps),
        "tokens_per_s_median": statistics.median(tps), "tokens_per_s_max": max(tps),
        "wall_seconds_median": statistics.median(r["wall_seconds"] for r in ok),
        "latency_mean_s": statistics.fmean(lat), "latency_p50_s": percentile(lat, 50),
        "latency_p90_s": percentile(lat, 90),
        "first_token_mean_s": statistics.fmean(q["first_token_s"] for q in reqs),
        "decode_tokens_per_s_mean": statistics.fmean(q["decode_tokens_per_s"] for q in reqs),
        "mean_batch_size": statistics.fmean(s["mean_batch_size"] for s in stats),
        "max_batch_size": max(s["max_batch_size"] for s in stats),
        "num_preemptions": sum(s["num_preemptions"] for s in stats),
        "max_kv_blocks_used": max(s["max_kv_blocks_used"] for s in stats),
        "prefix_cache_hit_rate": statistics.fmean(s.get("prefix_cache_hit_rate", 0.0)
                                                  for s in stats),
        "num_steps_mean": statistics.fmean(s["num_steps"] for s in stats),
        "step_seconds_median": percentile(step_s, 50),
        "step_seconds_max": max(step_s) if step_s else float("nan"),
        "decode_step_seconds_median": percentile([s[0] for s in decode], 50),
        "prefill_time_share": 1 - decode_s / sum(step_s) if step_s else 0.0,
        # Plain steps emit one token per request; speculative ones an unrecorded number.
        "decode_only_tokens_per_s": sum(s[1] for s in decode) / decode_s
        if mode == "plain" and decode_s else None,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "spec_paused_step_share": statistics.fmean(
            s.get("num_spec_paused_steps", 0) / max(1, s["num_steps"]) for s in stats),
        **_k_choices(stats), **throughput_ep.summarize(ok),
        "floor_fraction": statistics.median(r["floor_seconds"] / r["wall_seconds"]
                                            for r in ok) if all(
            "floor_seconds" in r for r in ok) else None}


def _k_choices(stats: list[dict]) -> dict:
    """The drafts K requests were allowed per step, pooled over runs: mean, share of K = 0,
    and the median step-time prediction error of the adaptive policy (None without one)."""
    hist: dict[int, int] = {}
    for s in stats:
        for k, n in s.get("draft_k_histogram", {}).items():
            hist[int(k)] = hist.get(int(k), 0) + n
    total = sum(hist.values())
    errors = [s["step_time_prediction_median_error"] for s in stats
              if s.get("step_time_prediction_median_error") is not None]
    return {"draft_k_histogram": dict(sorted(hist.items())),
            "draft_k_mean": sum(k * n for k, n in hist.items()) / total if total else None,
            "draft_k_zero_share": hist.get(0, 0) / total if total else None,
            "step_time_prediction_error": statistics.median(errors) if errors else None}


def is_decode_step(step: list) -> bool:
    """A step with no prompt tokens: every request computed its last token and its drafts."""
    num_requests, num_tokens, num_drafts = step[1:4]
    return num_tokens == num_requests + num_drafts


def _tps_by_rep(runs: list[dict], at_floor: bool = False) -> dict[tuple, float]:
    """{(rep, C, mode): tokens/s} of the successful runs; at_floor: the tokens/s a run at
    its floor would reach (runs without a floor left out)."""
    return {(r["rep"], r["concurrency"], r["mode"]):
            r["num_output_tokens"] / r["floor_seconds"] if at_floor else r["tokens_per_s"]
            for r in runs if "error" not in r and (not at_floor or r.get("floor_seconds"))}


def full_batch_tokens_per_s(run: dict) -> float | None:
    """Tokens emitted per second over the run's steps whose batch held every request it
    may (min(C, its requests)): the rate of a server that always has requests waiting.
    A finite run ends in a drain, its last requests running below C, and speculation
    staggers when requests finish while plain requests of one length finish together:
    on 16 SmolLM2 requests at C = 8 the drain cut the speculative modes' mean batch to
    6.4-6.8 against plain's 8.0. With one wave (C >= the requests) these are the steps
    until the first request finishes, its prompts' prefill a larger share of them the
    sooner that is. None for runs whose steps do not record their tokens."""
    full = min(run["concurrency"], len(run["requests"]))
    steps = [s for s in run["steps"] if len(s) > 6 and s[1] == full]
    seconds = sum(s[0] for s in steps)
    return sum(s[6] for s in steps) / seconds if seconds else None


def _full_batch_by_rep(runs: list[dict]) -> dict[tuple, float]:
    """{(rep, C, mode): `full_batch_tokens_per_s`} of the successful runs that record it."""
    tps = {(r["rep"], r["concurrency"], r["mode"]): full_batch_tokens_per_s(r)
           for r in runs if "error" not in r}
    return {k: v for k, v in tps.items() if v}


def _paired(tps: dict[tuple, float], num: tuple, den: tuple,
            den_tps: dict[tuple, float] | None = None) -> list[float]:
    """Per repetition: tokens/s of key `num` (concurrency, mode) over that of `den` (in
    den_tps when given)."""
    den_tps = tps if den_tps is None else den_tps
    reps = sorted({k[0] for k in tps})
    return [tps[(rep, *num)] / den_tps[(rep, *den)] for rep in reps
            if (rep, *num) in tps and (rep, *den) in den_tps]


def _summary(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "each": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "each": values}


def ratios(runs: list[dict]) -> dict:
    """Ratios within each repetition, summarised over repetitions (median, min, max):
    scaling[mode][str(C)] = tokens/s of mode at C / plain tokens/s at the smallest C;
    speedup[str(C)] = speculative tokens/s / plain tokens/s at C (keys are strings, as in
    the JSON file)."""
    tps = _tps_by_rep(runs)
    cs = sorted({k[1] for k in tps})
    modes = list(dict.fromkeys(k[2] for k in tps))
    if not cs:
        return {"baseline_concurrency": None, "scaling": {}, "speedup": {},
                "speedup_by_mode": {}}
    base = (cs[0], "plain")
    by_mode = _by_mode(tps, cs, modes)
    full = _full_batch_by_rep(runs)
    return {"baseline_concurrency": cs[0],
            "scaling": {m: {str(c): _summary(_paired(tps, (c, m), base)) for c in cs}
                        for m in modes},
            "speedup": by_mode.get("spec", {}), "speedup_by_mode": by_mode,
            "policy_targets": policy_targets(tps, cs, modes),
            # the same ratios over the steps at full occupancy (`full_batch_tokens_per_s`)
            "full_batch_speedup_by_mode": _by_mode(full, cs, modes) if full else {},
            "full_batch_policy_targets": policy_targets(full, cs, modes) if full else None}


def _by_mode(tps: dict[tuple, float], cs: list[int], modes: list[str]) -> dict:
    """{mode: {str(C): summary of its tokens/s over plain's, paired by repetition}}."""
    return {m: {str(c): _summary(_paired(tps, (c, m), (c, "plain"))) for c in cs}
            for m in modes if m != "plain"}


def policy_targets(tps: dict[tuple, float], cs: list[int], modes: list[str]) -> dict | None:
    """Issue targets of the adaptive policy, per C, ratios paired within each repetition
    (median): adaptive / plain (>= 0.97 at every C) and adaptive / the best static K of
    that repetition (>= 0.95 at every C). With the A/A control (`AA_MODE` ran), its ratio
    to plain per C (median, min, max over the repetitions) and the C at which adaptive
    missed the first target but read at least the A/A control's lowest ratio there
    (`misses_within_aa`: a miss the run cannot tell from noise). None unless "adaptive"
    and a "static:K" ran."""
    static = [m for m in modes if m.startswith("static:")]
    if "adaptive" not in modes or not static:
        return None
    per_c = {}
    for c in cs:
        reps = sorted({k[0] for k in tps if k[1] == c})
        best = {rep: max((tps[rep, c, m], m) for m in static if (rep, c, m) in tps)
                for rep in reps if any((rep, c, m) in tps for m in static)}
        vs_best = [tps[rep, c, "adaptive"] / best[rep][0] for rep in best
                   if (rep, c, "adaptive") in tps]
        per_c[str(c)] = {
            "vs_plain": _summary(_paired(tps, (c, "adaptive"), (c, "plain")))["median"],
            "vs_best_static": statistics.median(vs_best) if vs_best else None,
            "best_static": statistics.mode(m for _, m in best.values()) if best else None,
            "aa": _summary(_paired(tps, (c, AA_MODE), (c, "plain")))
            if AA_MODE in modes else None}
    worst_plain = min((v["vs_plain"] for v in per_c.values() if v["vs_plain"]), default=None)
    worst_best = min((v["vs_best_static"] for v in per_c.values()
                      if v["vs_best_static"]), default=None)
    return {"per_concurrency": per_c, "min_vs_plain": worst_plain,
            "min_vs_best_static": worst_best,
            "met": None if worst_plain is None or worst_best is None
            else worst_plain >= 0.97 and worst_best >= 0.95,
            "misses_within_aa": [c for c, v in per_c.items() if v["aa"] and v["aa"]["min"]
                                 and v["vs_plain"] is not None and v["vs_plain"] < 0.97
                                 and v["vs_plain"] >= v["aa"]["min"]]}


def target_line(runs: list[dict], concurrency: int = 16, required: float = 6.0) -> dict:
    """Whether plain tokens/s at `concurrency` >= `required` x plain tokens/s at C=1 (median
    of the per-repetition ratios); is_met None when C=1 or `concurrency` was not run."""
    text = (f"at {concurrency} concurrent requests, total tokens/s >= {required:g}x the "
            "single-request rate without speculation")
    tps = _tps_by_rep(runs)
    plain = _summary(_paired(tps, (concurrency, "plain"), (1, "plain")))
    spec = _summary(_paired(tps, (concurrency, "spec"), (1, "plain")))
    ratio = plain["median"]
    floor = _tps_by_rep(runs, at_floor=True)
    return {"text": text, "concurrency": concurrency, "required_ratio": required,
            "ratio": ratio, "ratio_min": plain["min"], "ratio_max": plain["max"],
            "spec_ratio": spec["median"],
            "is_met": None if ratio is None else ratio >= required,
            # C at its floor over C=1 as measured: an engine that schedules the same
            # tokens exceeds it only by multiplying faster than the probed peak
            "ceiling_ratio": _summary(_paired(floor, (concurrency, "plain"), (1, "plain"),
                                              tps))["median"]}


def slowest_steps(runs: list[dict], n: int = 5) -> list[dict]:
    """The n slowest engine steps of all runs, with their run and step counters."""
    steps = [dict(zip(STEP_FIELDS, s)) | {"mode": r["mode"], "rep": r["rep"],
                                          "concurrency": r["concurrency"], "step_index": i}
             for r in runs if "error" not in r for i, s in enumerate(r["steps"])]
    return sorted(steps, key=lambda s: -s["seconds"])[:n]
