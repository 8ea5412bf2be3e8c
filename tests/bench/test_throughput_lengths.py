"""`bench throughput --max-tokens-range-ratio R`: each prompt's output length drawn uniformly
from max_tokens x [1 - R, 1 + R], the same in every mode and repetition, and each request
generates exactly its prompt's length; prompts must fit the longest length."""

from __future__ import annotations

import json

import pytest

from specmoe.bench.throughput import ThroughputBenchConfig, assign_output_lengths
from specmoe.entrypoints.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(n: int) -> list[dict]:
    return [{"dataset": "d", "category": "c", "token_ids": [1, 2, 3]} for _ in range(n)]


def test_lengths_are_seeded_uniform_and_absent_without_a_ratio():
    cfg = ThroughputBenchConfig(max_tokens=48, max_tokens_range_ratio=0.5, seed=3)
    assert cfg.output_len_range == (24, 72)
    first, again = _prompts(400), _prompts(400)
    assign_output_lengths(first, cfg)
    assign_output_lengths(again, cfg)
    lengths = [p["max_tokens"] for p in first]
    assert lengths == [p["max_tokens"] for p in again]
    assert min(lengths) == 24 and max(lengths) == 72
    assert 44 < sum(lengths) / len(lengths) < 52
    plain = _prompts(4)
    assign_output_lengths(plain, ThroughputBenchConfig(max_tokens=48))
    assert all("max_tokens" not in p for p in plain)
    assert ThroughputBenchConfig(max_tokens=1, max_tokens_range_ratio=0.9
                                 ).output_len_range == (1, 2)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, float("nan")])
def test_a_ratio_outside_0_1_is_refused(ratio):
    with pytest.raises(ValueError, match="max_tokens_range_ratio"):
        ThroughputBenchConfig(max_tokens_range_ratio=ratio)


@pytest.mark.slow
def test_each_request_generates_its_prompts_length_in_every_mode(tmp_path):
    rc = main(["bench", "throughput", "--model", "tiny-moe", "--draft", "ngram",
               "--concurrency", "1,2", "--num-requests", "4", "--max-tokens", "8",
               "--max-tokens-range-ratio", "0.5", "--reps", "1", "--datasets", "spec_bench",
               "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0
    lengths = [p["max_tokens"] for p in results["prompts"]]
    assert all(4 <= n <= 12 for n in lengths) and len(set(lengths)) > 1
    for run in results["runs"]:
        assert run.get("error") is None
        assert [q["num_tokens"] for q in run["requests"]] == [
            lengths[q["prompt_index"]] for q in run["requests"]]
    assert "4-12 (uniform" in (tmp_path / "report.md").read_text()
