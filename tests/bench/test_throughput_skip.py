"""`specmoe bench throughput` on a model whose context cannot hold every prompt (tiny-moe: 512
tokens; Spec-Bench's third prompt has 1116): the prompts that cannot fit are skipped and
counted, not run to fail every run, and the command exits non-zero when runs fail or no
prompt fits."""

from __future__ import annotations

import json

import pytest

from specmoe.bench import throughput, throughput_run
from specmoe.bench.throughput import fitting_prompts
from specmoe.entrypoints.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# Spec-Bench and MT-Bench interleaved: token lengths 56, 52, 1116, 55 under tiny-moe
SMALL_RUN = ["bench", "throughput", "--model", "tiny-moe", "--draft", "none",
             "--concurrency", "1,2", "--num-requests", "4", "--max-tokens", "8", "--reps", "1"]


def _prompt(n: int) -> dict:
    return {"dataset": "d", "category": "c", "token_ids": [1] * n}


def test_a_prompt_fits_when_its_tokens_and_the_output_fit_the_context():
    fit, skipped = fitting_prompts([_prompt(504), _prompt(505), _prompt(3)], 8, 512)
    assert [len(p["token_ids"]) for p in fit] == [504, 3]
    assert [len(p["token_ids"]) for p in skipped] == [505]


@pytest.mark.slow
def test_too_long_prompts_are_skipped_and_counted_and_every_run_succeeds(tmp_path, capsys):
    rc = main([*SMALL_RUN, "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r.get("error") for r in results["runs"]] == [None, None]
    assert rc == 0
    assert [p["num_tokens"] for p in results["skipped_prompts"]] == [1116]
    assert len(results["prompts"]) == 3 and results["max_model_len"] == 512
    assert all(q["num_prompt_tokens"] + 8 <= 512 and q["num_tokens"] == 8
               for r in results["runs"] for q in r["requests"])
    assert "1 of 4 prompts skipped" in (tmp_path / "report.md").read_text()
    assert "caveat: 1 of 4 prompts skipped" in capsys.readouterr().out


@pytest.mark.slow
def test_the_aa_control_runs_a_second_plain_engine_alongside(tmp_path):
    rc = main([*SMALL_RUN, "--aa-control", "--concurrency", "1", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0 and [(r["mode"], r.get("error")) for r in results["runs"]] == [
        ("plain", None), ("plain2", None)]
    plain, aa = results["runs"]
    assert aa["num_output_tokens"] == plain["num_output_tokens"] == 4 * 8
    assert aa["engine_stats"]["spec_decode"]["num_draft_tokens"] == 0
    assert "| 1 | plain2 |" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:No artists with labels")  # the plot of no successful run
def test_failed_runs_exit_non_zero(tmp_path, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(throughput_run.RunRecorder, "advance", fail)
    assert main([*SMALL_RUN, "--out", str(tmp_path)]) == 1
    assert "2 of 2 runs failed, first: RuntimeError: boom" in capsys.readouterr().err


def test_no_prompt_that_fits_is_an_error(tmp_path, capsys):
    assert main([*SMALL_RUN, "--max-tokens", "600", "--out", str(tmp_path)]) == 2
    assert "all 4 prompts are too long for max_model_len=512 with max_tokens=600" \
        in capsys.readouterr().err


def test_speculative_engines_hold_the_cache_the_sweep_needs():
    cfg = throughput.ThroughputBenchConfig(model="tiny-moe", concurrency=[1, 4],
                                           max_tokens=8, num_speculative_tokens=3)
    # 4 requests x ceil((60 + 8 + 3 + 16) / 16) blocks
    assert throughput.workload_kv_blocks(cfg, [_prompt(20), _prompt(60)], 16) == 4 * 6
    fixed = throughput.ThroughputBenchConfig(model="tiny-moe", num_kv_blocks=99)
    assert throughput.workload_kv_blocks(fixed, [_prompt(20)], 16) is None


def test_warm_up_fits_an_adaptive_policy_before_the_timed_runs():
    """The adaptive engine runs warm-up batches until its step-time and drafting models are
    fitted (until then it drafts every request's own K, a cold start that is no run's to
    pay); an engine without a policy runs one."""
    from specmoe import LLM
    plain = LLM("tiny-moe", dtype="float32")
    adaptive = plain.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                       "num_speculative_tokens": 4, "policy": "adaptive"})
    assert not adaptive.engine.policy.calibrated
    throughput.warm_up({"plain": plain, "adaptive": adaptive},
                       [_prompt(12), _prompt(20)])
    policy = adaptive.engine.policy
    assert policy.calibrated and policy.draft_depth._observed >= policy.s.min_fit_steps
    assert plain.engine.stats.num_steps < adaptive.engine.stats.num_steps
