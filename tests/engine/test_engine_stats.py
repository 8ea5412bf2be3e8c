"""Engine-level totals of a batched speculative run on the bundled MoE pair: times counted
once per step (not once per request sharing it), tokens counted as they are emitted."""

from __future__ import annotations

import time

import pytest

from specmoe import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_batched_totals_stay_within_wall_time_and_count_every_token():
    llm = LLM("tiny-moe", dtype="float32",
              speculative={"method": "draft", "draft_model": "tiny-moe-draft",
                           "num_speculative_tokens": 3})
    prompts = ["The history of", "def main():", "In this paper we", "Once upon a time",
               "The results show", "import os"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    engine = llm.engine.stats
    assert engine.max_batch_size == len(prompts)
    assert 0 < engine.spec.draft_time_s and 0 < engine.spec.verify_time_s
    assert engine.spec.draft_time_s + engine.spec.verify_time_s <= wall
    per_request = sum(o.spec_stats.draft_time_s + o.spec_stats.verify_time_s for o in outs)
    assert per_request > engine.spec.draft_time_s + engine.spec.verify_time_s  # shared steps
    assert engine.num_generation_tokens == sum(len(o.token_ids) for o in outs)
    assert engine.spec.num_accepted_tokens == sum(o.spec_stats.num_accepted_tokens for o in outs)
