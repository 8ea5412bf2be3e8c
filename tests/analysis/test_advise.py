"""`specmoe advise`: the best K per batch size and the table that applies it, prompt files,
and the command on the bundled tiny MoE pair (which its draft does not speed up)."""

from __future__ import annotations

import json

import pytest

from specmoe.analysis.advise import (AdviseConfig, batch_size_table, best_k, compare_with_bench,
                                     median_error, predict_row, read_results, run_speedup,
                                     verify_seconds)
from specmoe.entrypoints.advise_cli import read_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(speedups: dict[int, list[float]]) -> list[dict]:
    return [{"B": b, "K": k, "predicted_speedup": s}
            for b, ss in speedups.items() for k, s in enumerate(ss, 1)]


def test_best_k_and_the_table_that_applies_it():
    best = best_k(_rows({1: [1.5, 1.9, 1.7], 2: [1.4, 1.8, 1.6], 4: [1.2, 1.1, 1.0],
                         8: [0.9, 0.8, 0.7], 16: [0.95, 0.6, 0.5]}))
    assert {b: v["K"] for b, v in best.items()} == {1: 2, 2: 2, 4: 1, 8: 0, 16: 0}
    assert best[8] == {"K": 0, "predicted_speedup": 1.0}
    assert batch_size_table(best) == {"1-3": 2, "4-7": 1, "8-4096": 0}
    assert batch_size_table({3: {"K": 4}}) == {"1-4096": 4}


def test_verification_priced_at_the_mean_window():
    tt = {(1, 1): 0.010, (1, 2): 0.012, (1, 3): 0.016, (2, 1): 0.020}
    assert verify_seconds(tt, 1, 2) == 0.012
    assert verify_seconds(tt, 1, 2.5) == pytest.approx(0.014)
    assert verify_seconds(tt, 1, 3) == 0.016
    with pytest.raises(ValueError, match="window 3.5 outside the measured T"):
        verify_seconds(tt, 1, 3.5)


def test_prefill_dilutes_the_decode_speedup():
    assert run_speedup(2.0, 0.0, 1.0) == pytest.approx(2.0)
    assert run_speedup(2.0, 1.0, 1.0) == pytest.approx(2 / 1.5)
    assert run_speedup(0.5, 1.0, 1.0) == pytest.approx(2 / 3)  # a slowdown shrinks too


def test_a_row_prices_ngram_at_its_drafted_window_and_a_draft_model_at_k_plus_1():
    tt = {(4, t): 0.010 + 0.002 * (t - 1) for t in range(1, 6)}
    steps = {"overhead_s": 0.001, "prefill_s": 0.1}
    a = {"k": 4, "tokens_per_step": 1.5, "steps": 100, "drafted": 150}
    lookup = predict_row(4, a, tt, 0.0, steps, AdviseConfig(model="m", draft="ngram",
                                                            max_tokens=51))
    assert lookup["verify_window"] == 2.5 and lookup["Tt_window_s"] == pytest.approx(0.013)
    assert lookup["decode_speedup"] == pytest.approx(1.5 * 0.011 / (0.013 + 0.001))
    plain = 50 * 0.011
    assert lookup["predicted_speedup"] == pytest.approx(
        (0.1 + plain) / (0.1 + plain / lookup["decode_speedup"]))
    draft = predict_row(4, a, tt, 0.002, steps, AdviseConfig(model="m", draft="d",
                                                             max_tokens=51))
    assert draft["verify_window"] == 5 and draft["Tt_window_s"] == pytest.approx(0.018)
    assert draft["decode_speedup"] == pytest.approx(1.5 * 0.011 / (0.018 + 4 * 0.002
                                                                   + 5 * 0.001))


def test_median_error():
    assert median_error({(1, 1): 1.1, (1, 2): 2.0, (2, 1): 0.5},
                        {(1, 1): 1.0, (1, 2): 2.0, (4, 4): 9.0}) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="no \\(B, K\\) in common"):
        median_error({(1, 1): 1.0}, {(2, 1): 1.0})


@pytest.mark.parametrize("bad, match", [
    (dict(batch_sizes=[0, 2]), "batch_sizes"), (dict(max_k=0), "max_k"),
    (dict(max_tokens=5), "max_tokens"), (dict(prompts=["  "]), "no non-empty prompt"),
    (dict(prompts=["a"], datasets=["mt_bench"]), "prompts or datasets"),
    (dict(num_prompts=0), "num_prompts=0")])
def test_config_checks(bad, match):
    with pytest.raises(ValueError, match=match):
        AdviseConfig(model="m", draft="ngram", **bad)


def test_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond\n")
    assert read_prompts(str(txt)) == ["first prompt", "second"]
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    assert read_prompts(str(jl)) == ["a", "b"]
    jl.write_text(json.dumps({"other": 1}) + "\n")
    with pytest.raises(ValueError, match="line 1: no 'prompt' or 'text'"):
        read_prompts(str(jl))
    jl.write_text("{oops\n")
    with pytest.raises(ValueError, match="line 1: not JSON"):
        read_prompts(str(jl))
    with pytest.raises(ValueError, match="no such file"):
        read_prompts(str(tmp_path / "none.txt"))


def _bench(speedups: dict[str, dict[str, float]]) -> dict:
    """bench throughput results with these median speedups by mode and C."""
    return {"ratios": {"speedup_by_mode": {
        mode: {c: {"median": v, "each": [v]} for c, v in by_c.items()}
        for mode, by_c in speedups.items()}}}


def test_compare_with_bench():
    advice = {"rows": _rows({1: [1.2, 1.5], 4: [1.1, 0.9], 8: [0.8, 0.6]}),
              "best": {"1": {"K": 2}, "4": {"K": 1}, "8": {"K": 0}}}
    bench = _bench({"static:1": {"1": 1.0, "4": 1.1, "16": 0.7},
                    "static:2": {"1": 1.5, "4": 0.6}, "adaptive": {"1": 1.4, "4": 1.0}})
    cmp = compare_with_bench(advice, bench)
    assert [(r["B"], r["K"]) for r in cmp["rows"]] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert [r["error"] for r in cmp["rows"]] == pytest.approx([0.2, 0.0, 0.0, 0.5])
    assert cmp["median_error"] == pytest.approx(0.1)
    assert cmp["best"] == {1: {"advised_K": 2, "measured_best_K": 2},
                           4: {"advised_K": 1, "measured_best_K": 1}}
    with pytest.raises(ValueError, match="no \\(B, K\\) in common"):
        compare_with_bench(advice, _bench({"adaptive": {"1": 1.0}}))


def test_compare_from_saved_files(tmp_path, capsys):
    import gzip

    from specmoe.entrypoints.cli import main
    advice = tmp_path / "advice.json"
    advice.write_text(json.dumps({"rows": _rows({1: [1.2]}), "best": {"1": {"K": 1}}}))
    bench = tmp_path / "results.json.gz"
    with gzip.open(bench, "wt") as f:
        json.dump(_bench({"static:1": {"1": 1.5}}), f)
    assert read_results(bench)["ratios"]["speedup_by_mode"]["static:1"]["1"]["median"] == 1.5
    assert main(["advise", "--from-advice", str(advice), "--compare", str(bench)]) == 0
    assert "median error 20.0% over 1 (B, K)" in capsys.readouterr().out
    assert main(["advise", "--from-advice", str(advice)]) == 2
    assert "needs --compare" in capsys.readouterr().err
    assert main(["advise", "--draft", "ngram"]) == 2
    assert "--model and --draft are required" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{oops")
    assert main(["advise", "--from-advice", str(tmp_path / "bad.json"), "--compare",
                 str(bench)]) == 2
    assert "not a JSON results file" in capsys.readouterr().err


@pytest.mark.slow
def test_advise_on_the_tiny_pair(tmp_path, capsys):
    from specmoe import LLM
    from specmoe.bench.throughput import ThroughputBenchConfig, build_prompts
    from specmoe.entrypoints.cli import main
    assert main(["advise", "--model", "tiny-moe", "--draft", "tiny-moe-draft",
                 "--batch-sizes", "1,2", "--max-k", "2", "--max-tokens", "12",
                 "--datasets", "humaneval,spec_bench", "--num-prompts", "3",
                 "--dtype", "float32", "--threads", "1", "--out", str(tmp_path)]) == 0
    advice = json.loads((tmp_path / "advice.json").read_text())
    bench = ThroughputBenchConfig(model="tiny-moe", datasets=["humaneval", "spec_bench"],
                                  num_requests=3, concurrency=[3])
    want = [len(p["token_ids"]) for p in build_prompts(bench, LLM("tiny-moe"))]
    assert advice["prompt_tokens"] == want  # the bench's own prompts
    assert [(r["B"], r["K"]) for r in advice["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in advice["rows"]:
        assert r["Tt_window_s"] > 0 and r["Td_1_s"] > 0 and r["engine_overhead_s"] >= 0
        assert r["verify_window"] == r["K"] + 1 and r["prefill_s"] > 0
        assert 1.0 <= r["tokens_per_step"] <= r["K"] + 1
    assert {(t["B"], t["T"]) for t in advice["tt"]} == {(b, t) for b in (1, 2)
                                                       for t in (1, 2, 3)}
    assert set(advice["best"]) == {"1", "2"}
    out = capsys.readouterr().out
    assert "batch_size_table: " + json.dumps(advice["batch_size_table"]) in out
    assert main(["advise", "--model", "tiny-moe", "--draft", "ngram", "--max-k", "0"]) == 2
