"""`bench throughput` alternates the modes wave by wave within a run (`run_interleaved`), so
the machine's drift hits every mode alike: the order of the waves, the runs equal to whole
runs of each mode, and a mode that fails dropped from the later waves while the others go
on; a closed-loop run keeps C requests in flight."""

from __future__ import annotations

import pytest

from specmoe import LLM
from specmoe.bench import throughput

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines():
    plain = LLM("tiny-moe", dtype="float32")
    return {"plain": plain,
            "spec": plain.with_speculative({"method": "ngram", "num_speculative_tokens": 3})}


@pytest.fixture(scope="module")
def prompts():
    return [{"dataset": "d", "category": "c", "token_ids": ids}
            for ids in ([5, 17, 42, 99, 7], [3, 3, 8, 1, 3, 3, 8], [11, 12, 13])]


def _logged_waves(monkeypatch, engines):
    """(mode, prompt indices) of every wave run, in order."""
    names = {id(llm): mode for mode, llm in engines.items()}
    log, real = [], throughput._run_wave

    def run_wave(llm, prompts, indices, max_tokens, concurrency):
        log.append((names[id(llm)], list(indices)))
        return real(llm, prompts, indices, max_tokens, concurrency)
    monkeypatch.setattr(throughput, "_run_wave", run_wave)
    return log


def test_waves_alternate_and_each_run_is_a_whole_run(engines, prompts, monkeypatch):
    log = _logged_waves(monkeypatch, engines)
    runs = throughput.run_interleaved(engines, ["plain", "spec"], prompts, 1, 6, 3)
    assert log == [("plain", [0]), ("spec", [0]), ("spec", [1]), ("plain", [1]),
                   ("plain", [2]), ("spec", [2])]
    monkeypatch.undo()
    for mode in ("plain", "spec"):
        run, whole = runs[mode], throughput.run_once(engines[mode], prompts, 1, 6, 3)
        assert run["num_waves"] == whole["num_waves"] == 3
        assert run["num_output_tokens"] == whole["num_output_tokens"] == 18
        assert [q["prompt_index"] for q in run["requests"]] == [0, 1, 2]
        assert run["wall_seconds"] > 0 and run["tokens_per_s"] > 0
        assert len(run["steps"]) == run["engine_stats"]["num_steps"] > 0
    assert runs["spec"]["engine_stats"]["spec_decode"]["num_draft_tokens"] > 0
    assert runs["plain"]["engine_stats"]["spec_decode"]["num_draft_tokens"] == 0


def test_a_failing_mode_is_dropped_and_the_others_go_on(engines, prompts, monkeypatch):
    log = _logged_waves(monkeypatch, engines)
    real, tried = throughput._run_wave, []

    def fail_spec(llm, prompts, indices, max_tokens, concurrency):
        if llm is engines["spec"]:
            tried.append(list(indices))
            raise RuntimeError("boom")
        return real(llm, prompts, indices, max_tokens, concurrency)
    monkeypatch.setattr(throughput, "_run_wave", fail_spec)
    runs = throughput.run_interleaved(engines, ["plain", "spec"], prompts, 2, 4, 3)
    assert runs["spec"] == {"concurrency": 2, "error": "RuntimeError: boom"}
    assert runs["plain"]["num_output_tokens"] == 12 and runs["plain"]["num_waves"] == 2
    assert log == [("plain", [0, 1]), ("plain", [2])]
    assert tried == [[0, 1]]  # not run again after its first failure


def test_interleave_option():
    with pytest.raises(ValueError, match="interleave='mode'"):
        throughput.ThroughputBenchConfig(interleave="mode")
    from specmoe.entrypoints.cli import build_parser
    args = build_parser().parse_args(["bench", "throughput", "--interleave", "run"])
    assert args.interleave == "run"
    assert build_parser().parse_args(["bench", "throughput"]).interleave == "wave"


def test_a_closed_loop_keeps_c_requests_in_flight(engines, prompts, monkeypatch):
    """arrival="closed": one wave of every request per mode, at most C running, the next
    submitted as soon as one finishes (different lengths: they finish apart), the modes'
    order reversed on odd repetitions, the KV cache whole afterwards."""
    log = _logged_waves(monkeypatch, engines)
    llm = engines["plain"]
    sched = llm.engine.scheduler
    running, real_schedule = [], sched.schedule

    def schedule():
        out = real_schedule()
        running.append(len(sched.running))
        return out
    monkeypatch.setattr(sched, "schedule", schedule)
    free = llm.engine.scheduler.kv_cache.block_pool.num_free_blocks
    runs = throughput.run_interleaved(engines, ["plain", "spec"], prompts * 2, 2, 5, 5,
                                      arrival="closed", reverse=True)
    assert log == [("spec", [0, 1, 2, 3, 4]), ("plain", [0, 1, 2, 3, 4])]
    assert max(running) == 2 and running.count(2) > len(running) // 2
    run = runs["plain"]
    assert sorted(q["prompt_index"] for q in run["requests"]) == [0, 1, 2, 3, 4]
    assert run["num_output_tokens"] == 25
    assert all(0 < q["latency_s"] < run["wall_seconds"] for q in run["requests"])
    assert llm.engine.scheduler.kv_cache.block_pool.num_free_blocks == free
    assert throughput.waves_for(3, 2, 5, "closed") == [[0, 1, 2, 0, 1]]
    with pytest.raises(ValueError, match="arrival='poisson'"):
        throughput.ThroughputBenchConfig(arrival="poisson")
    from specmoe.entrypoints.cli import build_parser
    assert build_parser().parse_args(["bench", "throughput", "--arrival", "closed"]
                                     ).arrival == "closed"
