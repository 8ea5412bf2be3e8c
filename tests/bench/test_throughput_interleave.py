"""`bench throughput` alternates the modes within a run (`run_interleaved`), so the machine's
drift hits every mode alike: by turns of stepping (`slice_seconds`) or wave by wave, the runs
equal to whole runs of each mode, the time between a mode's turns counted in none of its
figures, a mode that fails dropped from the later turns while the others go on, every KV
cache block given back after an interrupt; a closed-loop run keeps C requests in flight."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from specmoe import LLM
from specmoe.bench import throughput, throughput_run
from specmoe.bench.throughput_run import ClosedLoop, run_interleaved, run_once

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
    """(mode, prompt indices) of every wave, in the order they are planned."""
    names = {id(llm): mode for mode, llm in engines.items()}
    log, real = [], ClosedLoop.__init__

    def init(self, llm, prompts, indices, *args):
        log.append((names[id(llm)], list(indices)))
        real(self, llm, prompts, indices, *args)
    monkeypatch.setattr(ClosedLoop, "__init__", init)
    return log


def _free_blocks(engines) -> list[int]:
    return [llm.engine.scheduler.kv_cache.block_pool.num_free_blocks
            for llm in engines.values()]


def test_waves_alternate_and_each_run_is_a_whole_run(engines, prompts, monkeypatch):
    log = _logged_waves(monkeypatch, engines)
    runs = run_interleaved(engines, ["plain", "spec"], prompts, 1, 6, 3)
    assert log == [("plain", [0]), ("spec", [0]), ("spec", [1]), ("plain", [1]),
                   ("plain", [2]), ("spec", [2])]
    monkeypatch.undo()
    for mode in ("plain", "spec"):
        run, whole = runs[mode], run_once(engines[mode], prompts, 1, 6, 3)
        assert run["num_waves"] == whole["num_waves"] == 3
        assert run["num_output_tokens"] == whole["num_output_tokens"] == 18
        assert [q["prompt_index"] for q in run["requests"]] == [0, 1, 2]
        assert run["wall_seconds"] > 0 and run["tokens_per_s"] > 0
        assert len(run["steps"]) == run["engine_stats"]["num_steps"] > 0
    assert runs["spec"]["engine_stats"]["spec_decode"]["num_draft_tokens"] > 0
    assert runs["plain"]["engine_stats"]["spec_decode"]["num_draft_tokens"] == 0


def test_slices_alternate_and_the_pauses_count_nowhere(engines, prompts):
    """Turns of one step each (a slice shorter than any step), a 30 ms pause after every
    turn: the modes take turns in alternating order until each run ends, each run equals a
    whole run alone, and no latency, time to first token or wall time holds a pause."""
    turns = []

    def pause(mode: str, finished: int) -> None:
        turns.append((mode, finished))
        time.sleep(0.03)
    runs = run_interleaved(engines, ["plain", "spec"], prompts * 2, 2, 5, 6,
                           on_progress=pause, arrival="closed", slice_seconds=1e-6)
    plain_steps = runs["plain"]["engine_stats"]["num_steps"]
    spec_steps = runs["spec"]["engine_stats"]["num_steps"]
    assert len(turns) == plain_steps + spec_steps  # one step a turn
    both = min(plain_steps, spec_steps)
    assert [m for m, _ in turns[:2 * both]] == ["plain", "spec", "spec", "plain"] * (
        both // 2) + ["plain", "spec"] * (both % 2)
    for mode, run in runs.items():
        assert sum(n for m, n in turns if m == mode) == 6
        assert run["num_output_tokens"] == run_once(engines[mode], prompts * 2, 2, 5, 6,
                                                    "closed")["num_output_tokens"] == 30
        assert run["wall_seconds"] < 0.03 * len(turns) / 2
        for q in run["requests"]:
            assert 0 < q["first_token_s"] <= q["latency_s"] < run["wall_seconds"]


def test_a_failing_mode_is_dropped_and_the_others_go_on(engines, prompts, monkeypatch):
    log = _logged_waves(monkeypatch, engines)
    real, tried = ClosedLoop.advance, []

    def fail_spec(self, seconds=None):
        if self.llm is engines["spec"]:
            tried.append(sorted(self.queue))
            raise RuntimeError("boom")
        return real(self, seconds)
    monkeypatch.setattr(ClosedLoop, "advance", fail_spec)
    free = _free_blocks(engines)
    runs = run_interleaved(engines, ["plain", "spec"], prompts, 2, 4, 3)
    assert runs["spec"] == {"concurrency": 2, "error": "RuntimeError: boom"}
    assert runs["plain"]["num_output_tokens"] == 12 and runs["plain"]["num_waves"] == 2
    assert log == [("plain", [0, 1]), ("spec", [0, 1]), ("plain", [2])]
    assert tried == [[0, 1]]  # not run again after its first failure
    sliced = run_interleaved(engines, ["spec", "plain"], prompts, 2, 4, 3, arrival="closed",
                             slice_seconds=1e-6)
    assert sliced["spec"]["error"] == "RuntimeError: boom"
    assert sliced["plain"]["num_output_tokens"] == 12
    assert _free_blocks(engines) == free


def test_an_interrupt_gives_every_block_back(engines, prompts):
    """A KeyboardInterrupt between turns ends the sweep with both modes' requests still in
    flight: both engines get every KV cache block back."""
    free = _free_blocks(engines)

    def interrupt(mode: str, finished: int) -> None:
        if mode == "spec":
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_interleaved(engines, ["plain", "spec"], prompts, 2, 8, 3, on_progress=interrupt,
                        arrival="closed", slice_seconds=1e-6)
    assert _free_blocks(engines) == free
    assert not any(llm.engine.scheduler.running for llm in engines.values())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_balanced_orders_put_every_mode_after_every_other_equally_often(n):
    rows = throughput_run.balanced_orders(n)
    assert len(rows) == (2 * n if n % 2 else n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    for position in range(n):  # every mode in every position equally often
        assert sorted(row[position] for row in rows) == sorted(list(range(n)) * (len(rows) // n))
    pairs = Counter((row[j], row[j + 1]) for row in rows for j in range(n - 1))
    assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(pairs.values())) <= 1  # each ordered pair as often as any other


def test_four_modes_take_turns_in_balanced_orders(engines, prompts, monkeypatch):
    """Wave by wave, four modes: turn i takes them in balanced order row `start` + i."""
    four = engines | {"plain2": engines["plain"].with_speculative(None),
                      "spec2": engines["spec"].with_speculative(
                          {"method": "ngram", "num_speculative_tokens": 2})}
    log = _logged_waves(monkeypatch, four)
    modes = list(four)
    run_interleaved(four, modes, prompts, 1, 3, 2, start=1)
    rows = throughput_run.balanced_orders(4)
    assert [m for m, _ in log] == [modes[j] for j in rows[1] + rows[2]]


def test_interleave_options():
    with pytest.raises(ValueError, match="interleave='mode'"):
        throughput.ThroughputBenchConfig(interleave="mode")
    with pytest.raises(ValueError, match="slice_seconds=0"):
        throughput.ThroughputBenchConfig(slice_seconds=0)
    from specmoe.entrypoints.cli import build_parser
    args = build_parser().parse_args(["bench", "throughput", "--interleave", "run"])
    assert args.interleave == "run"
    args = build_parser().parse_args(["bench", "throughput"])
    assert (args.interleave, args.slice_seconds) == ("slice", throughput_run.SLICE_SECONDS)
    assert build_parser().parse_args(["bench", "throughput", "--slice-seconds", "0.25"]
                                     ).slice_seconds == 0.25


def test_a_closed_loop_keeps_c_requests_in_flight(engines, prompts, monkeypatch):
    """arrival="closed": one wave of every request per mode, at most C running, the next
    submitted as soon as one finishes (different lengths: they finish apart), the modes'
    order starting at the second balanced order, the KV cache whole afterwards."""
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
    runs = run_interleaved(engines, ["plain", "spec"], prompts * 2, 2, 5, 5,
                           arrival="closed", start=1)
    assert log == [("spec", [0, 1, 2, 3, 4]), ("plain", [0, 1, 2, 3, 4])]
    assert max(running) == 2 and running.count(2) > len(running) // 2
    run = runs["plain"]
    assert sorted(q["prompt_index"] for q in run["requests"]) == [0, 1, 2, 3, 4]
    assert run["num_output_tokens"] == 25
    assert all(0 < q["latency_s"] < run["wall_seconds"] for q in run["requests"])
    assert llm.engine.scheduler.kv_cache.block_pool.num_free_blocks == free
    assert throughput_run.waves_for(3, 2, 5, "closed") == [[0, 1, 2, 0, 1]]
    with pytest.raises(ValueError, match="arrival='poisson'"):
        throughput.ThroughputBenchConfig(arrival="poisson")
    from specmoe.entrypoints.cli import build_parser
    assert build_parser().parse_args(["bench", "throughput", "--arrival", "closed"]
                                     ).arrival == "closed"
