"""The real-model study: Tt(B, T) on real text through a prefilled cache, the decode-phase
end-to-end runs (lossless, counts add up), the speedup algebra of the predictions, the
report, and the CLI from end to end on the bundled tiny MoE pair."""

from __future__ import annotations

import json

import pytest
import torch

from specmoe.analysis import cost_model as cm
from specmoe.analysis.real_study import (RealStudyConfig, analyse, run_real_study,
                                        token_windows)
from specmoe.analysis.real_study_report import render_real_report
from specmoe.analysis.verify_cost import VerifyCostBench
from specmoe.layers.moe.backends import moe_blocks
from specmoe.layers.moe.stats import NullExpertStats
from specmoe.worker.model_runner import SequenceInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(models=["tiny-moe", "tiny-moe-draft"], draft="tiny-moe-draft",
            batch_sizes=[1, 2], num_tokens=[1, 2, 3], e2e_batch_sizes=[1, 2], ks=[1, 2],
            reps=1, e2e_reps=1, context_len=24, prompt_tokens=24, max_tokens=6,
            dtype="float32")


@pytest.mark.parametrize("bad, match", [
    (dict(num_tokens=[2, 3]), "must include 1"),
    (dict(ks=[1, 4]), r"lacks T=\[5\]"),
    (dict(e2e_batch_sizes=[1, 8]), r"\[8\] are not in batch_sizes"),
    (dict(models=[]), "no target models"),
    (dict(e2e_reps=0), "e2e_reps"),
])
def test_config_rejects_inconsistent_grids(bad, match):
    with pytest.raises(ValueError, match=match):
        RealStudyConfig(**{**TINY, **bad})


@pytest.fixture(scope="module")
def tiny_moe():
    from specmoe.engine.llm_engine import LLM
    return LLM("tiny-moe", dtype="float32")


def test_bench_on_real_text_continues_the_prefilled_context(tiny_moe):
    cfg = RealStudyConfig(**TINY)
    windows = token_windows(tiny_moe.tokenizer, cfg)
    assert len(windows) == 2 and all(len(w) == 24 + 3 for w in windows)
    runner = tiny_moe.target
    bench = VerifyCostBench(runner, None, 24, 2, 3, token_windows=windows)
    # the timed tokens' logits are those of one forward over the whole window
    logits = runner.execute(bench.cache, bench._inputs(2, 3))
    for b, window in enumerate(windows):
        cache = runner.new_paged_cache(2, 16)
        whole = runner.execute(cache, [SequenceInput(window, 0, [0, 1], 3)])
        torch.testing.assert_close(logits[3 * b:3 * b + 3], whole, rtol=1e-4, atol=1e-4)
    seconds, unique = bench.time_forward(2, 3)
    assert seconds > 0 and len(unique) == len(moe_blocks(runner.model))
    assert all(1 <= u <= 2 * 3 * runner.arch.moe.top_k for u in unique)
    # counted once per point on real text; the timed forward ran the served path
    assert bench.time_forward(2, 3)[1] is unique
    assert all(type(b.stats) is NullExpertStats for b in moe_blocks(runner.model))


def test_short_token_windows_are_refused(tiny_moe):
    with pytest.raises(ValueError, match="token window 0 has 5 tokens; need"):
        VerifyCostBench(tiny_moe.target, None, 24, 1, 3, token_windows=[[1] * 5])


def _synthetic_results(overhead: float = 0.002) -> dict:
    """A study result whose end-to-end times follow the speedup algebra exactly."""
    cfg = RealStudyConfig(**{**TINY, "models": ["m"]})
    shape = cm.ShapeCounts(2, 100, 200, 0, 0, 50, 8, 0, 0, 2)
    tt = {(b, t): 0.010 * b + 0.001 * b * t for b in (1, 2) for t in (1, 2, 3)}
    td = {1: 0.003, 2: 0.004}
    e2e = []
    for b in (1, 2):
        plain_step = tt[b, 1] + overhead
        e2e.append({"B": b, "K": 0, "identical_to_plain": True, "runs": [
            {"seconds": 10 * plain_step, "tokens": 10 * b, "steps": 10, "drafts": 0,
             "accepted": 0}]})
        for k, al in ((1, 1.5), (2, 2.0)):
            step = tt[b, k + 1] + k * td[b] + (1 + k) * overhead
            e2e.append({"B": b, "K": k, "identical_to_plain": True, "runs": [
                {"seconds": 10 * step, "tokens": int(10 * b * al), "steps": 10,
                 "drafts": 10 * b, "accepted": int(10 * b * (al - 1))}]})
    target = {"model": "m", "arch": vars(shape), "draft_arch": vars(shape), "e2e": e2e,
              "points": [{"B": b, "T": t, "min_s": s} for (b, t), s in tt.items()],
              "draft_points": [{"B": b, "T": 1, "min_s": s} for b, s in td.items()]}
    machine = cm.MachineProfile(1e10, 1e10, [1, 1024], [1e-10, 1e-8])
    return {"config": vars(cfg), "machine": machine.to_json(), "targets": [target],
            "seconds": 1.0}, machine


def test_forward_time_prediction_is_exact_when_the_algebra_holds():
    results, machine = _synthetic_results()
    a = analyse(results, machine)
    assert len(a["speedups"]) == 4
    for row in a["speedups"]:
        assert row["engine_overhead_s"] == pytest.approx(0.002)
        assert row["forward_times_speedup"] == pytest.approx(row["measured_speedup"])
    assert a["speedup_errors"]["all"]["forward_times"]["median"] == pytest.approx(0, abs=1e-9)
    # a dense model: Amdahl says verification costs what one token does
    assert all(f["amdahl_s"] == pytest.approx(
        next(g["measured_s"] for g in a["forwards"]
             if (g["model"], g["B"], g["T"]) == (f["model"], f["B"], 1)))
        for f in a["forwards"])
    results["analysis"] = a
    report = render_real_report(results)
    assert "## Answers" in report and "B=1" in report and "4 of 4" in report
    # K = 2 verifies T = 3, outside the cost model's fit; a run of K = 1 alone has no such K
    assert a["speedup_errors"]["all, K>=2"]["forward_times"]["n"] == 2
    k1 = {**results, "targets": [{**t, "e2e": [c for c in t["e2e"] if c["K"] < 2]}
                                 for t in results["targets"]]}
    assert "all, K>=2" not in analyse(k1, machine)["speedup_errors"]


def test_reanalyse_refits_a_saved_run_without_measuring(tmp_path, capsys):
    from specmoe.entrypoints.cli import main
    results, machine = _synthetic_results()
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(results))
    out = tmp_path / "refit"
    assert main(["study", "--reanalyse", str(saved), "--out", str(out)]) == 0
    refit = json.loads((out / "results.json").read_text())
    assert refit["analysis"]["speedups"] == analyse(results, machine)["speedups"]
    assert refit["targets"] == results["targets"]
    assert "fitted on T in [1, 2]" in (out / "report.md").read_text()
    # a preset study's results.json is refused by name, and nothing is written
    other = tmp_path / "presets.json"
    other.write_text(json.dumps({"presets": {}, "machine": {}}))
    assert main(["study", "--reanalyse", str(other), "--out", str(tmp_path / "x")]) == 2
    assert f"--reanalyse {other}: not the results.json of a real-model study" in \
        capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_cli_runs_the_real_study_on_the_tiny_pair(tmp_path):
    from specmoe.entrypoints.cli import main
    out = tmp_path / "report"
    assert main(["study", "--models", "tiny-moe,tiny-moe-draft", "--draft", "tiny-moe-draft",
                 "--batch-sizes", "1,2", "--num-tokens", "1,2,3", "--ks", "1,2",
                 "--e2e-batch-sizes", "1,2", "--reps", "1", "--e2e-reps", "1",
                 "--context-len", "24", "--prompt-tokens", "24", "--max-tokens", "6",
                 "--dtype", "float32", "--threads", "1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["analysis"]["speedups"]
    assert {(r["model"], r["B"], r["K"]) for r in rows} == {
        (m, b, k) for m in ("tiny-moe", "tiny-moe-draft") for b in (1, 2) for k in (1, 2)}
    assert all(r["identical"] and 1.0 <= r["AL"] <= r["K"] + 1 for r in rows)
    # the draft as its own target accepts every draft (the last step is cut by max_tokens)
    assert all(r["AL"] >= 2.0 for r in rows if r["model"] == "tiny-moe-draft")
    for t in results["targets"]:
        for cell in t["e2e"]:
            run = cell["runs"][0]
            assert run["tokens"] > 0 and run["steps"] > 0
            assert run["tokens"] <= cell["B"] * 6
    for name in ("report.md", "verify_ratio_vs_B.png", "speedup_vs_B.png"):
        assert (out / name).stat().st_size > 0


def test_run_real_study_needs_models_that_exist():
    with pytest.raises((FileNotFoundError, ValueError)):
        run_real_study(RealStudyConfig(**{**TINY, "models": ["no-such-model"]}))
