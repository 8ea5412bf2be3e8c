"""`specmoe bench throughput` bookkeeping on hand-made runs: per-(C, mode) rows, ratios
within each repetition, the target line, the report and its plot (no model)."""

from __future__ import annotations

import json

import pytest

from specmoe.bench.throughput import ThroughputBenchConfig, round_robin
from specmoe.bench.throughput_run import waves_for
from specmoe.bench.throughput_stats import (STEP_FIELDS, aggregate, full_batch_tokens_per_s,
                                            is_decode_step, percentile, ratios, slowest_steps,
                                            target_line)
from specmoe.bench.throughput_report import caveats, markdown, target_sentence, write_report
from specmoe.utils.data import Prompt


def _run(rep, c, mode, tps, latencies=None, drafts=0, accepted=0, preempted=0,
         step_seconds=(0.1, 0.2), prefill_seconds=None):
    latencies = latencies or [1.0] * c
    num_tokens = 8 * c
    return {
        "mode": mode, "rep": rep, "concurrency": c, "wall_seconds": num_tokens / tps,
        "num_output_tokens": num_tokens, "tokens_per_s": tps,
        "requests": [{"prompt_index": i, "num_prompt_tokens": 10, "num_tokens": 8,
                      "finish_reason": "length", "latency_s": lat, "first_token_s": lat / 4,
                      "decode_tokens_per_s": 7 / (lat * 3 / 4)}
                     for i, lat in enumerate(latencies)],
        "steps": ([[prefill_seconds, c, 100 * c, 0, 0, 0, 0]] if prefill_seconds else [])
        + [[s, c, c, 0, 0, c, c] for s in step_seconds],
        "engine_stats": {"num_steps": len(step_seconds), "mean_batch_size": c * 0.9,
                         "max_batch_size": c, "num_scheduled_tokens": 0,
                         "num_preemptions": preempted, "max_kv_blocks_used": 3 * c,
                         "prefix_cache_hit_rate": 0.1 * rep,
                         "spec_decode": {"num_drafts": drafts, "num_draft_tokens": 4 * drafts,
                                         "num_accepted_tokens": accepted},
                         "last_step": None}}


@pytest.fixture
def runs():
    # Rep 0 is a fast machine, rep 1 a slow one (all figures halved): ratios within a
    # repetition must not see the drift.
    out = []
    for rep, f in ((0, 1.0), (1, 0.5)):
        out += [_run(rep, 1, "plain", 10 * f, latencies=[2.0]),
                _run(rep, 1, "spec", 15 * f, latencies=[1.0], drafts=10, accepted=20),
                _run(rep, 16, "plain", 70 * f, latencies=[float(i) for i in range(1, 17)],
                     preempted=1, prefill_seconds=1.0),
                _run(rep, 16, "spec", 56 * f, latencies=[3.0] * 16, drafts=40, accepted=20,
                     step_seconds=(0.3, 2.5 if rep else 0.4))]
    return out


def _row(rows, c, mode):
    return next(r for r in rows if r["concurrency"] == c and r["mode"] == mode)


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0


def test_aggregate_rows(runs):
    rows = aggregate(runs)
    assert [(r["concurrency"], r["mode"]) for r in rows] == [
        (1, "plain"), (1, "spec"), (16, "plain"), (16, "spec")]
    p16 = _row(rows, 16, "plain")
    assert p16["tokens_per_s"] == [70, 35]
    assert (p16["tokens_per_s_min"], p16["tokens_per_s_median"]) == (35, 52.5)
    assert p16["latency_mean_s"] == pytest.approx(8.5)   # 1..16, pooled over both reps
    assert p16["latency_p50_s"] == pytest.approx(8.5)
    assert p16["latency_p90_s"] == pytest.approx(percentile(list(range(1, 17)) * 2, 90))
    assert p16["first_token_mean_s"] == pytest.approx(8.5 / 4)
    assert p16["num_preemptions"] == 2
    assert p16["max_kv_blocks_used"] == 48
    assert p16["mean_batch_size"] == pytest.approx(14.4)
    assert p16["prefix_cache_hit_rate"] == pytest.approx(0.05)
    # Prefill steps (prompt tokens) are set aside by the decode-only figures.
    assert p16["prefill_time_share"] == pytest.approx(2.0 / 2.6)
    assert p16["decode_step_seconds_median"] == pytest.approx(0.15)
    assert p16["decode_only_tokens_per_s"] == pytest.approx(64 / 0.6)
    assert p16["decode_only_scaling"] == pytest.approx(16.0)
    assert _row(rows, 1, "plain")["prefill_time_share"] == 0.0
    s16 = _row(rows, 16, "spec")
    assert s16["decode_only_tokens_per_s"] is None and "decode_only_scaling" not in s16
    assert s16["mean_acceptance_length"] == pytest.approx(1 + 40 / 80)
    assert s16["acceptance_rate"] == pytest.approx(40 / 320)
    assert s16["step_seconds_max"] == 2.5
    assert _row(rows, 1, "plain")["mean_acceptance_length"] == 1.0


def test_ratios_are_paired_within_repetitions(runs):
    r = ratios(runs)
    assert r["baseline_concurrency"] == 1
    assert r["scaling"]["plain"]["16"]["each"] == pytest.approx([7.0, 7.0])
    assert r["scaling"]["spec"]["1"]["median"] == pytest.approx(1.5)
    assert r["speedup"]["16"]["median"] == pytest.approx(0.8)
    assert r["speedup"]["1"]["min"] == pytest.approx(1.5)


def test_target_line(runs):
    t = target_line(runs, 16, 6.0)
    assert t["is_met"] is True and t["ratio"] == pytest.approx(7.0)
    assert t["spec_ratio"] == pytest.approx(5.6)
    assert target_line(runs, 16, 8.0)["is_met"] is False
    assert target_line(runs, 32, 6.0)["is_met"] is None
    assert "NOT MET" in target_sentence(target_line(runs, 16, 8.0))
    assert "not evaluated" in target_sentence(target_line(runs, 32, 6.0))


def test_errors_are_counted_not_aggregated(runs):
    runs = runs + [{"mode": "plain", "rep": 2, "concurrency": 16, "error": "RuntimeError: x"}]
    row = _row(aggregate(runs), 16, "plain")
    assert (row["num_reps"], row["num_errors"]) == (2, 1)
    assert ratios(runs)["scaling"]["plain"]["16"]["each"] == pytest.approx([7.0, 7.0])


def test_slowest_steps(runs):
    top = slowest_steps(runs, n=2)
    assert [s["seconds"] for s in top] == [2.5, 1.0]
    assert set(STEP_FIELDS) <= set(top[0])
    assert (top[0]["concurrency"], top[0]["mode"], top[0]["rep"]) == (16, "spec", 1)


def test_is_decode_step():
    assert is_decode_step([0.1, 4, 4, 0, 0])
    assert is_decode_step([0.1, 4, 20, 16, 0])       # last token + 4 drafts each
    assert not is_decode_step([0.1, 4, 300, 0, 0])   # a prompt chunk in the batch


def test_prompt_helpers():
    assert waves_for(8, 1, 3) == [[0], [1], [2]]          # C < num_requests: waves
    assert waves_for(8, 2, 5) == [[0, 1], [2, 3], [4]]
    assert waves_for(8, 4, 4) == [[0, 1, 2, 3]]
    assert waves_for(3, 7, 2) == [[0, 1, 2, 0, 1, 2, 0]]   # prompts cycled
    ps = [Prompt("x", c, f"{c}{i}") for c in "ab" for i in range(3)]
    assert [p.text for p in round_robin(ps, 4)] == ["a0", "b0", "a1", "b1"]
    assert len(round_robin(ps, 10)) == 6


def test_config_validation():
    assert ThroughputBenchConfig(concurrency=[4, 1, 4]).concurrency == [1, 4]
    assert ThroughputBenchConfig(draft="none").modes == ["plain"]
    with pytest.raises(ValueError, match="concurrency"):
        ThroughputBenchConfig(concurrency=[0])
    with pytest.raises(ValueError, match="datasets"):
        ThroughputBenchConfig(datasets=["nope"])
    with pytest.raises(ValueError, match="reps"):
        ThroughputBenchConfig(reps=0)


def _results(runs):
    import dataclasses
    return {"config": dataclasses.asdict(ThroughputBenchConfig()),
            "environment": {"torch_num_threads": 2, "cpu_count": 2,
                            "load_average_start": 1.0, "load_average_end": 2.0},
            "load_seconds": 1.0, "prompts": [{"dataset": "mt_bench", "category": "writing",
                                              "num_tokens": 10}],
            "rows": aggregate(runs), "ratios": ratios(runs),
            "target": target_line(runs), "slowest_steps": slowest_steps(runs),
            "runs": runs, "total_seconds": 60.0}


def test_markdown_and_files(runs, tmp_path):
    runs = runs + [{"mode": "spec", "rep": 0, "concurrency": 32, "error": "RuntimeError: boom"}]
    results = _results(runs)
    md = markdown(results)
    assert "**MET**: 7.00x" in md
    assert "| 16 | plain | 52.50 | 35.00 | 7.00x |  |" in md
    assert "| 16 | spec | 42.00 | 28.00 | 5.60x | 0.80x |" in md
    assert "| 32 | spec | failed (1 errors) |" in md
    assert "- rep 0 C=32 spec: RuntimeError: boom" in md
    paths = write_report(results, tmp_path / "out")
    assert [p.name for p in paths] == ["results.json", "report.md",
                                       "throughput_vs_concurrency.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    reloaded = json.loads(paths[0].read_text())
    assert markdown(reloaded) == md  # the report can be rebuilt from the JSON file
    assert "float32, greedy" in md  # no quantised weights named
    assert ("C at a time (each submitted as one finishes)" in md
            and "(at each C the modes' runs take turns of 0.1 s of stepping" in md)
    results["config"]["mode_order"] = "balanced"
    assert ("stepping, in a balanced order each turn: every mode after every other one "
            "equally often)") in markdown(results)
    del results["config"]["mode_order"]  # results saved before the balanced orders
    results["config"]["interleave"] = "wave"
    assert "(at each C the modes' runs alternate, their order reversed" in markdown(results)
    results["config"]["arrival"] = "waves"
    assert "requests in waves of C" in markdown(results)
    assert "(at each C the modes alternate wave by wave)" in markdown(results)
    results["config"]["interleave"] = "run"
    assert "(plain then speculative at each C)" in markdown(results)
    results["config"] |= {"quantization": "int8", "draft_quantization": "int4"}
    results["environment"]["int4_batch_invariant"] = True
    assert "float32, int8 target weights, int4 draft weights, greedy" in markdown(results)
    results["config"]["quantization"] = "int4"
    assert ("float32, int4 target weights, int4 draft weights, int4 batch-invariant mode, "
            "greedy") in markdown(results)
    assert "prefetch" not in md  # results from before the setting
    results["environment"]["one_row_prefetch"] = {"on": True, "source": "tuned", "bytes": 3e8,
                                                  "off_s": 0.0147, "on_s": 0.0113}
    assert ("one-row weight prefetch on (tuned: a one-row pass over 300 MB of weights 14.7 ms "
            "without, 11.3 ms with); total") in markdown(results)
    results["environment"]["one_row_prefetch"] = {"on": False, "source": "env"}
    assert "one-row weight prefetch off (env); total" in markdown(results)


def test_caveats(runs):
    results = _results(runs)  # load 1.0 + 2 threads on 2 CPUs; reps differ by 2x
    busy, noisy = caveats(results)
    assert "machine was busy" in busy and "--threads 1" in busy
    assert "C=1 plain (2.0x)" in noisy and "C=16 spec (2.0x)" in noisy
    assert "**Caveat**: the machine was busy" in markdown(results)
    quiet = _results([r for r in runs if r["rep"] == 0])
    quiet["environment"] |= {"load_average_start": 0.2, "torch_num_threads": 1}
    assert caveats(quiet) == []


def _policy_runs():
    """Plain, two static Ks and adaptive at C=1 and C=16, two repetitions (rep 1 at half
    speed): static:4 wins at C=1, static:1 at C=16; adaptive is close to the best of each."""
    tps = {1: {"plain": 10, "static:1": 12, "static:4": 15, "adaptive": 14.7},
           16: {"plain": 70, "static:1": 60, "static:4": 40, "adaptive": 69}}
    out = []
    for rep, f in ((0, 1.0), (1, 0.5)):
        for c, modes in tps.items():
            for mode, t in modes.items():
                run = _run(rep, c, mode, t * f)
                if mode == "adaptive":
                    run["engine_stats"] |= {"draft_k_histogram": {0: 3, 4: 1},
                                            "step_time_prediction_median_error": 0.04}
                out.append(run)
    return out


def test_policy_modes_are_compared_with_plain_and_the_best_static_k():
    runs = _policy_runs()
    r = ratios(runs)
    assert set(r["speedup_by_mode"]) == {"static:1", "static:4", "adaptive"}
    assert r["speedup_by_mode"]["static:4"]["1"]["median"] == pytest.approx(1.5)
    t = r["policy_targets"]
    assert t["per_concurrency"]["1"]["best_static"] == "static:4"
    assert t["per_concurrency"]["16"]["best_static"] == "static:1"
    assert t["per_concurrency"]["1"]["vs_best_static"] == pytest.approx(14.7 / 15)
    assert t["min_vs_plain"] == pytest.approx(69 / 70)
    assert t["min_vs_best_static"] == pytest.approx(14.7 / 15) and t["met"] is True
    rows = aggregate(runs)
    assert [row["mode"] for row in rows if row["concurrency"] == 1] == [
        "plain", "static:1", "static:4", "adaptive"]
    a = _row(rows, 1, "adaptive")
    assert a["draft_k_mean"] == pytest.approx(1.0) and a["draft_k_zero_share"] == 0.75
    assert a["step_time_prediction_error"] == pytest.approx(0.04)
    md = markdown(_results(runs) | {"rows": rows, "ratios": r})
    assert "## Speculation policies" in md
    assert "| C | static:1 | static:4 | adaptive | adaptive K mean / off |" in md
    assert "| 1 | 1.20x | 1.50x | 1.47x | 1.00 / 75% |" in md
    assert "worst 0.99x) and >= 0.95x the best static K at every C (worst 0.98x): met" in md
    runs[-1]["tokens_per_s"] = 50  # adaptive at C=16, rep 1: 50 against plain's 35
    assert ratios(runs)["policy_targets"]["met"] is True
    runs[-1]["tokens_per_s"] = 20
    assert ratios(runs)["policy_targets"]["met"] is False


def test_the_aa_control_bounds_what_a_run_can_tell_from_noise():
    """A second plain engine ("plain2") reads 0.95-1.02x plain: adaptive's 0.96x at C=16
    misses 0.97x but lies inside that band; its 0.90x after a slower repetition does not."""
    runs = _policy_runs()
    for rep, f in ((0, 1.0), (1, 0.5)):
        runs += [_run(rep, 1, "plain2", 10.2 * f), _run(rep, 16, "plain2", 66.5 * f)]
    for r in runs:
        if r["concurrency"] == 16 and r["mode"] == "adaptive":
            r["tokens_per_s"] = 0.96 * 70 * (1.0 if r["rep"] == 0 else 0.5)
    t = ratios(runs)["policy_targets"]
    assert t["per_concurrency"]["16"]["best_static"] == "static:1"  # plain2 is no static K
    assert t["per_concurrency"]["16"]["aa"]["min"] == pytest.approx(0.95)
    assert t["per_concurrency"]["1"]["aa"]["median"] == pytest.approx(1.02)
    assert t["met"] is False and t["misses_within_aa"] == ["16"]
    md = markdown(_results(runs) | {"rows": aggregate(runs), "ratios": ratios(runs)})
    assert ("A/A control (a second engine without speculation over plain, min-max of the "
            "repetitions): C=1 1.02-1.02x, C=16 0.95-0.95x. Adaptive's misses of 0.97x "
            "plain within that band: C=16.") in md
    slow = next(r for r in runs if (r["rep"], r["concurrency"], r["mode"]) == (1, 16, "adaptive"))
    slow["tokens_per_s"] = 0.85 * 35  # median over the repetitions now 0.905x
    assert ratios(runs)["policy_targets"]["misses_within_aa"] == []
    assert "policy_targets" in ratios(_policy_runs())
    assert ratios(_policy_runs())["policy_targets"]["misses_within_aa"] == []
    assert "A/A control" not in markdown(_results(_policy_runs()) | {
        "rows": aggregate(_policy_runs()), "ratios": ratios(_policy_runs())})


def test_full_occupancy_rate_leaves_out_the_drain():
    """Plain's requests of one length finish together; the speculative run's drain ends
    on one request (a 0.1 s step emitting 1 token): over whole runs it reads below plain,
    over the steps with both requests in flight above it."""
    def run(mode, steps):
        r = _run(0, 2, mode, 1.0)
        r["steps"] = [[sec, n, n, 0, 0, n, emitted] for sec, n, emitted in steps]
        r["num_output_tokens"] = sum(s[6] for s in r["steps"])
        r["wall_seconds"] = sum(s[0] for s in r["steps"])
        r["tokens_per_s"] = r["num_output_tokens"] / r["wall_seconds"]
        return r
    plain = run("plain", [(0.1, 2, 2)] * 8)                          # 16 tokens in 0.8 s
    spec = run("spec", [(0.125, 2, 3)] * 4 + [(0.1, 1, 1)] * 4)      # 16 tokens in 0.9 s
    assert full_batch_tokens_per_s(plain) == pytest.approx(20.0)
    assert full_batch_tokens_per_s(spec) == pytest.approx(24.0)
    assert full_batch_tokens_per_s(plain | {"steps": [s[:6] for s in plain["steps"]]}) is None
    r = ratios([plain, spec])
    assert r["speedup_by_mode"]["spec"]["2"]["median"] == pytest.approx(0.8 / 0.9)
    assert r["full_batch_speedup_by_mode"]["spec"]["2"]["median"] == pytest.approx(1.2)
    md = markdown(_results([plain, spec]) | {"rows": aggregate([plain, spec]), "ratios": r})
    assert "### At full occupancy" not in md  # one speculative mode: no policy section
    runs = _policy_runs()
    md = markdown(_results(runs) | {"rows": aggregate(runs), "ratios": ratios(runs)})
    assert "### At full occupancy" in md


def test_policy_config():
    from specmoe.bench.throughput import policy_speculative
    cfg = ThroughputBenchConfig(policies=["static:2", "adaptive", "table"],
                                batch_size_table={"1-4": 4, "5-64": 0})
    assert cfg.modes == ["plain", "static:2", "adaptive", "table"]
    assert ThroughputBenchConfig(policies=["adaptive"], aa_control=True).modes == [
        "plain", "plain2", "adaptive"]
    assert ThroughputBenchConfig(aa_control=True).modes == ["plain", "plain2", "spec"]
    assert ThroughputBenchConfig(draft="none", aa_control=True).modes == ["plain", "plain2"]
    assert policy_speculative("adaptive", 8, None) == {
        "policy": "adaptive", "num_speculative_tokens": 8, "match_trim": True}
    assert policy_speculative("adaptive:notrim", 8, None)["match_trim"] is False
    assert policy_speculative("table", 8, {"1-4": 4})["num_speculative_tokens"] == 4
    for bad in ("static:0", "static:x", "greedy"):
        with pytest.raises(ValueError, match=f"invalid policy '{bad}'"):
            ThroughputBenchConfig(policies=[bad])
    with pytest.raises(ValueError, match="needs a batch_size_table"):
        ThroughputBenchConfig(policies=["table"])
    with pytest.raises(ValueError, match="need a draft"):
        ThroughputBenchConfig(draft="none", policies=["adaptive"])


def test_the_expert_parallel_section_names_the_dispatch_and_placement():
    from specmoe.bench.throughput_report import expert_parallel_section
    rows = [{"concurrency": 1, "mode": "plain", "communication_share": 0.4,
             "collective_bytes_per_forward": 2048, "rank_load": [3, 4]}]
    assert expert_parallel_section([{"concurrency": 1, "mode": "plain"}]) == []
    text = "\n".join(expert_parallel_section(rows, {"expert_parallel_dispatch": "all_to_all",
                                                    "expert_placement": "p.json"}))
    assert "Dispatch `all_to_all`, placement `p.json`" in text and "all-gather" in text
    text = "\n".join(expert_parallel_section(rows))
    assert "Dispatch `replicated`, placement `contiguous`" in text and "all-reduce" in text
    assert "| 1 | plain | 40% | 2 | 3 / 4 |" in text
