"""`specmoe study` end to end on one-layer presets and a small grid: every output is written,
every figure is consistent with the raw timings, and bad options are refused."""

from __future__ import annotations

import json

import pytest

from specmoe.analysis.study import StudyConfig
from specmoe.entrypoints.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    argv = ["study", "--out", str(out), "--presets", "moe-8x2,dense-active",
            "--batch-sizes", "1,2,4", "--num-tokens", "1,2,3", "--reps", "1",
            "--context-len", "16", "--scale-layers", "0.17", "--routing-model", "none",
            "--e2e-model", "none",
            "--threads", "1"]
    assert main(argv) == 0
    return out


@pytest.mark.slow
def test_study_writes_every_output(report):
    for name in ("report.md", "results.json", "tt_ratio_vs_T.png", "speedup_vs_B.png",
                 "cost_model_fit.png", "unique_experts_per_step.png"):
        assert (report / name).stat().st_size > 0, name
    text = (report / "report.md").read_text()
    assert "## Findings" in text and "cost model's median error" in text
    assert "moe-8x2" in text and "dense-active" in text


@pytest.mark.slow
def test_study_results_are_consistent(report):
    r = json.loads((report / "results.json").read_text())
    moe = r["presets"]["moe-8x2"]
    assert moe["preset"]["num_layers"] == 1
    assert len(moe["points"]) == 9
    for p in moe["points"]:
        assert p["min_s"] <= p["median_s"] and p["predicted_s"] > 0
        assert 2 <= p["unique_experts"] <= 8
        assert p["uniform_unique_experts"] == pytest.approx(8 * (1 - 0.75 ** (p["B"] * p["T"])))
    rows = r["speedup"]["moe-8x2"]["rows"]
    pts = {(p["B"], p["T"]): p["min_s"] for p in moe["points"]}
    td = {p["B"]: p["min_s"] for p in r["draft"]["points"]}
    for row in rows:
        b, k = row["B"], row["K"]
        expected = row["AL"] / (pts[b, k + 1] / pts[b, 1] + k * td[b] / pts[b, 1])
        assert row["speedup"] == pytest.approx(expected)
    assert {row["K"] for row in rows} == {1, 2}
    assert r["acceptance"]["lengths"]["1"] == pytest.approx(1.8032, abs=1e-3)


def test_study_refuses_bad_options(capsys):
    assert main(["study", "--presets", "draft"]) == 2
    assert "invalid presets ['draft']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must include 1"):
        StudyConfig(num_tokens=[2, 3])
    with pytest.raises(ValueError, match="routing='nope'"):
        StudyConfig(routing="nope")


def _trace_file(tmp_path, num_experts=8, top_k=2, num_layers=2):
    """Two sequences of 20 on-sequence tokens with overlap-0.5 routing, plus rejected rows."""
    import numpy as np

    from specmoe.analysis.routing_gen import CorrelatedRouting
    from specmoe.analysis.routing_trace import RoutingTrace, write_trace
    rng = np.random.default_rng(0)
    ids = CorrelatedRouting(num_experts, top_k, 0.5).sample(2 * num_layers, 20, rng)
    experts = ids.reshape(2, num_layers, 20, top_k).transpose(0, 2, 1, 3).reshape(-1, num_layers,
                                                                                   top_k)
    n = len(experts)
    phase = np.array((["prefill"] * 8 + ["decode"] * 12) * 2, "<U8")
    trace = RoutingTrace(num_experts, top_k, list(range(num_layers)), ["a"] * 20 + ["b"] * 20,
                         np.tile(np.arange(20), 2), np.zeros(n, np.int64), phase, experts,
                         np.full(experts.shape, 1.0 / top_k, np.float32), "hand-made")
    return write_trace(trace, tmp_path / "trace.jsonl")


@pytest.mark.slow
def test_study_replays_and_analyses_a_trace(tmp_path):
    path = _trace_file(tmp_path)
    out = tmp_path / "report"
    argv = ["study", "--out", str(out), "--presets", "moe-8x2,dense-active",
            "--batch-sizes", "1,2,4", "--num-tokens", "1,2", "--reps", "1",
            "--context-len", "8", "--scale-layers", "0.17", "--routing", "trace",
            "--routing-trace", str(path), "--e2e-model", "none", "--threads", "1"]
    assert main(argv) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["presets"]["moe-8x2"]["routing"]["name"] == "trace"
    learned = r["learned_routing"]
    assert learned["analysis"]["num_tokens"] == 40
    assert learned["analysis"]["overlap"]["baseline_uniform"]["value"] == pytest.approx(0.25)
    assert "Learned routing (trace" in (out / "report.md").read_text()
    assert (out / "overlap_vs_distance.png").stat().st_size > 0


@pytest.mark.slow
def test_a_trace_of_another_shape_gets_a_preset_of_its_shape(tmp_path):
    path = _trace_file(tmp_path, num_experts=16, top_k=4)
    out = tmp_path / "r"
    argv = ["study", "--out", str(out), "--presets", "moe-8x2,dense-active", "--routing",
            "trace", "--routing-trace", str(path), "--scale-layers", "0.17", "--reps", "1",
            "--batch-sizes", "1,2", "--num-tokens", "1,2", "--context-len", "8",
            "--routing-model", "none", "--e2e-model", "none", "--threads", "1"]
    assert main(argv) == 0
    r = json.loads((out / "results.json").read_text())
    assert list(r["presets"]) == ["moe-16x4", "dense-active"]
    p = r["presets"]["moe-16x4"]["preset"]
    assert (p["num_experts"], p["top_k"], p["intermediate_size"]) == (16, 4, 128 * 384 // 16)
    assert any("replaced by moe-16x4" in w for w in r["warnings"])


@pytest.mark.parametrize("extra,message", [
    (["--num-tokens", "1"], "a T >= 2"),
    (["--draft-cost-ratio", "-1"], "draft_cost_ratio=-1.0"),
    (["--draft-cost-ratio", "nan"], "draft_cost_ratio=nan"),
    (["--overlap", "2"], "overlap=2.0"),
    (["--reps", "0"], "reps=0"),
    (["--seed", "-1"], "seed=-1"),
    (["--device", "tpu"], "device='tpu'"),
    (["--presets", "moe-8x2", "--batch-sizes", "1,2"], "points to fit the cost model"),
    (["--acceptance", "1=1.5", "--num-tokens", "1,3"], "measures no T = K + 1"),
    (["--acceptance", "1=1.5", "--acceptance-json", "x.json"], "not both"),
    (["--acceptance-json", "/nonexistent/results.json"], "does not exist"),
    (["--acceptance-group", "nope"], "groups are"),
    (["--routing", "trace"], "needs routing_trace"),
    (["--routing-trace", "/nonexistent.jsonl"], "nonexistent.jsonl"),
])
def test_bad_options_fail_before_measuring(extra, message, capsys):
    assert main(["study", "--routing-model", "none", "--e2e-model", "none", *extra]) == 2
    assert message in capsys.readouterr().err


def test_bad_out_paths_and_acceptance_text(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert main(["study", "--out", str(a_file), "--routing-model", "none"]) == 2
    assert "is a file" in capsys.readouterr().err
    for bad in ("garbage", "1=0.5", "1=1.5,1=1.6", ""):
        with pytest.raises(SystemExit):
            main(["study", "--acceptance", bad])
        assert "acceptance length" in capsys.readouterr().err


@pytest.mark.parametrize("models", [["--routing-model", "/nonexistent/moe"],
                                    ["--e2e-model", "/nonexistent/moe"],
                                    ["--e2e-draft", "/nonexistent/moe"]])
def test_missing_models_fail_before_measuring(models, capsys, monkeypatch):
    from specmoe.analysis.cost_model import MachineProfile
    monkeypatch.setattr(MachineProfile, "measure", lambda *a, **k: pytest.fail("measured"))
    assert main(["study", *models]) == 2
    assert "/nonexistent/moe" in capsys.readouterr().err


def test_missing_prompt_data_fails_before_measuring(tmp_path, capsys, monkeypatch):
    from specmoe.analysis.cost_model import MachineProfile
    monkeypatch.setattr(MachineProfile, "measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setenv("SPECMOE_DATA_DIR", str(tmp_path))
    assert main(["study"]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_quick_fills_only_what_is_not_given():
    from specmoe.entrypoints.study_cli import QUICK, config_from_args
    parse = lambda *a: config_from_args(build_parser().parse_args(["study", *a]))  # noqa: E731
    quick = parse("--quick")
    assert {k: getattr(quick, k) for k in QUICK} == QUICK
    mixed = parse("--quick", "--reps", "2", "--batch-sizes", "1,2")
    assert (mixed.reps, mixed.batch_sizes, mixed.presets) == (2, [1, 2], QUICK["presets"])
    full = parse()
    assert (full.batch_sizes, full.reps) == (StudyConfig().batch_sizes, StudyConfig().reps)
    assert full.dtype in ("bfloat16", "float32")  # auto, resolved for this machine


def _point(b: int, t: int, seconds: list[float]) -> dict:
    return {"B": b, "T": t, "seconds": seconds, "min_s": min(seconds)}


def test_impossible_and_noisy_points_are_named():
    """Verifying 5 tokens measured cheaper than 1, repetitions 60% apart and a cost model
    38% off each give a warning naming the figure; a clean grid gives none."""
    from specmoe.analysis.study_findings import measurement_warnings
    noisy = {"moe": {"points": [_point(4, 1, [1.0, 1.1]), _point(4, 5, [0.86, 1.38])]}}
    fit = {"errors": {"all": {"cost_model": {"median": 0.38}}}}
    warnings = measurement_warnings(noisy, fit)
    assert any("Tt(4, 5) / Tt(4, 1) = 0.86 < 1" in w for w in warnings)
    assert any("1 of 2 points spread by more than 25%" in w and "T=5, 60%" in w
               for w in warnings)
    assert any("median error is 38%" in w for w in warnings)
    clean = {"moe": {"points": [_point(4, 1, [1.0, 1.05]), _point(4, 5, [1.3, 1.35])]}}
    assert measurement_warnings(clean, {"errors": {"all": {"cost_model": {"median": 0.05}}}}) \
        == []


@pytest.mark.slow
def test_study_prints_its_findings_and_writes_under_out_by_default(report, tmp_path, capsys,
                                                                    monkeypatch):
    """The terminal gets the findings (not only report.md), and without --out the report
    goes to out/study-DATE-TIME, not into the working directory's study-report/."""
    from specmoe.analysis.study_findings import findings
    from specmoe.entrypoints import study_cli
    results = json.loads((report / "results.json").read_text())
    monkeypatch.setattr(study_cli, "run_study", lambda cfg, plan, console: (results, None))
    monkeypatch.setattr(study_cli, "write_outputs", lambda results, out, analysis: None)
    monkeypatch.chdir(tmp_path)
    assert main(["study", "--quick", "--routing-model", "none", "--e2e-model", "none"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "findings" in err
    for line in findings(results):
        assert " ".join(line.split())[:60] in err
    made = list((tmp_path / "out").glob("study-*"))
    assert len(made) == 1 and not (tmp_path / "study-report").exists()
