"""The engine over 2 processes with the experts sharded (`LLM(expert_parallel_size=2)`):
rank 0 schedules and broadcasts every forward, the worker mirrors it; greedy output, plain
and with draft speculation, equals one process's, and shutdown stops the worker."""

from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]


def test_two_processes_give_the_single_process_greedy_tokens():
    prompts = [[5, 17, 42, 99, 7, 23, 11], [3, 3, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    single = LLM("tiny-moe", dtype="float32")
    want = [o.token_ids for o in single.generate(prompts, params)]
    ep = LLM("tiny-moe", dtype="float32", expert_parallel_size=2)
    try:
        assert [o.token_ids for o in ep.generate(prompts, params)] == want
        spec = ep.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                    "num_speculative_tokens": 3})
        assert [o.token_ids for o in spec.generate(prompts, params)] == want
        workers = list(ep._workers)
    finally:
        ep.shutdown()
    assert all(not p.is_alive() and p.exitcode == 0 for p in workers)


def test_dense_models_and_bad_sizes_are_refused():
    import multiprocessing
    with pytest.raises(ValueError, match="expert_parallel_size=0"):
        LLM("tiny-moe", expert_parallel_size=0)
    with pytest.raises(ValueError, match="needs a MoE model"):
        LLM("tiny-moe-draft", dtype="float32", expert_parallel_size=2)
    assert not multiprocessing.active_children()
