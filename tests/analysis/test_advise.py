"""`specmoe advise`: the best K per batch size and the table that applies it, prompt files,
and the command on the bundled tiny MoE pair (which its draft does not speed up)."""

from __future__ import annotations

import json

import pytest

from specmoe.analysis.advise import (AdviseConfig, batch_size_table, best_k, median_error)
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


def test_median_error():
    assert median_error({(1, 1): 1.1, (1, 2): 2.0, (2, 1): 0.5},
                        {(1, 1): 1.0, (1, 2): 2.0, (4, 4): 9.0}) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="no \\(B, K\\) in common"):
        median_error({(1, 1): 1.0}, {(2, 1): 1.0})


@pytest.mark.parametrize("bad, match", [
    (dict(batch_sizes=[0, 2]), "batch_sizes"), (dict(max_k=0), "max_k"),
    (dict(max_tokens=5), "max_tokens"), (dict(prompts=["  "]), "no non-empty prompt")])
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


@pytest.mark.slow
def test_advise_on_the_tiny_pair(tmp_path, capsys):
    from specmoe.entrypoints.cli import main
    assert main(["advise", "--model", "tiny-moe", "--draft", "tiny-moe-draft",
                 "--batch-sizes", "1,2", "--max-k", "2", "--max-tokens", "12",
                 "--dtype", "float32", "--threads", "1", "--out", str(tmp_path)]) == 0
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert [(r["B"], r["K"]) for r in advice["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in advice["rows"]:
        assert r["Tt_K+1_s"] > 0 and r["Td_1_s"] > 0 and r["engine_overhead_s"] >= 0
        assert 1.0 <= r["tokens_per_step"] <= r["K"] + 1
    assert set(advice["best"]) == {"1", "2"}
    out = capsys.readouterr().out
    assert "batch_size_table: " + json.dumps(advice["batch_size_table"]) in out
    assert main(["advise", "--model", "tiny-moe", "--draft", "ngram", "--max-k", "0"]) == 2
