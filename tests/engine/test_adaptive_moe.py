"""The adaptive policy on a MoE target (the bundled tiny-moe with its draft): routing
overlap measured on sampled steps feeds the step-time model's expert term, the sampled
steps give the blocks their own recorders back (the fused driver needs them), and greedy
outputs stay those of plain decoding."""

from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams
from specmoe.layers.moe.backends import moe_blocks
from specmoe.layers.moe.stats import NullExpertStats

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_adaptive_policy_measures_routing_overlap_on_a_moe_target():
    plain = LLM("tiny-moe", dtype="float32")
    spec = plain.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                   "num_speculative_tokens": 4, "policy": "adaptive"})
    core = spec.engine
    assert core.policy.s.is_moe and core.policy.step_time.moe
    core.policy.routing_sampler.every = 2
    prompts = [[5 + i, 17, 42, 99, 7 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert core.policy._overlap_obs > 0 and 0.0 <= core.policy.overlap <= 1.0
    assert all(type(b.stats) is NullExpertStats for b in moe_blocks(plain.target.model))
    assert core.stats.num_step_time_predictions > 0
    n = plain.target.arch.moe.num_experts
    assert core.policy.unique_fraction([1]) == pytest.approx(
        plain.target.arch.moe.top_k / n)


def test_engines_from_one_llm_share_one_draft_copy_and_keep_their_own_caches():
    plain = LLM("tiny-moe", dtype="float32")
    draft = {"method": "draft", "draft_model": "tiny-moe-draft", "num_speculative_tokens": 3}
    static = plain.with_speculative(draft, num_kv_blocks=40)
    adaptive = plain.with_speculative(draft | {"policy": "adaptive"}, num_kv_blocks=40)
    other = plain.with_speculative(draft | {"draft_quantization": "int8"})
    assert static.proposer.runner is adaptive.proposer.runner
    assert other.proposer.runner is not static.proposer.runner
    assert static.proposer.cache is not adaptive.proposer.cache
    assert static.engine.kv_cache is not adaptive.engine.kv_cache
    assert static.engine.scheduler.kv_cache.num_blocks == 40
    prompts = [[5 + i, 17, 42, 99, 7 + i] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    for llm in (static, adaptive, static):
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_drafting_is_priced_apart_from_catch_ups_over_the_tokens_left():
    """The engine hands the policy each drafting call's catch-ups and, on a solve, each
    request's tokens left; outputs stay those of plain decoding."""
    plain = LLM("tiny-moe", dtype="float32")
    spec = plain.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                   "num_speculative_tokens": 4, "policy": "adaptive"})
    policy = spec.engine.policy
    seen = []
    shares = policy._catch_up_shares

    def spy(request_ids, gains, caps, pending, remaining):
        seen.append(remaining())
        return shares(request_ids, gains, caps, pending, remaining)
    policy._catch_up_shares = spy
    prompts = [[5 + i, 17, 42, 99, 7 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    calls = list(policy.draft_depth._calls)
    assert len(calls) >= policy.s.min_fit_steps and policy.calibrated
    assert max(c[1] for c in calls) >= 4  # a 5-token prompt's first draft call
    assert seen and all(0 < r <= 24 for left in seen for r in left)
    assert policy.draft_depth.coef is not None


def test_routing_is_sampled_only_on_small_steps_with_adjacent_tokens():
    """A step of single-token decodes has no adjacent pair to measure, and a large prompt
    chunk would run its many rows off the fused driver: neither is sampled (it stays on
    the fused driver) nor counted towards `every`."""
    from specmoe.spec_decode.routing_overlap import RoutingSampler
    model = LLM("tiny-moe", dtype="float32").target.model
    sampler = RoutingSampler(model, every=2, max_rows=64)
    assert [sampler.begin(1, 16) for _ in range(5)] == [False] * 5
    assert [sampler.begin(512, 512) for _ in range(3)] == [False] * 3
    assert sampler.begin(3, 40) is False
    assert all(type(b.stats) is NullExpertStats for b in moe_blocks(model))
    assert sampler.begin(2, 64) is True  # the second small multi-row step
    assert sampler.end([2]) is None  # no forward ran in between: nothing recorded
    assert all(type(b.stats) is NullExpertStats for b in moe_blocks(model))


def test_idle_leases_skip_the_policy_and_keep_outputs_and_counts():
    """With speculation held off (a poor draft on tiny-moe, no probes), most steps are
    leased (`AdaptivePolicy.grant_lease`): the policy is not consulted, yet the K histogram
    still counts every (request, step) that could draft, and outputs stay plain."""
    plain = LLM("tiny-moe", dtype="float32")
    spec = plain.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                   "num_speculative_tokens": 4, "policy": "adaptive"})
    core, policy = spec.engine, spec.engine.policy
    policy.probe_interval = 10**9
    leased, live = [], []
    leased_step, verify = policy.leased_step, core._verify

    def counted_lease(*args):
        leased.append(leased_step(*args))
        return leased[-1]

    def counted_verify(sampled, reqs, logits):
        result = verify(sampled, reqs, logits)
        live.append(sum(not r.is_finished for r in reqs))
        return result

    policy.leased_step, core._verify = counted_lease, counted_verify
    prompts = [[5 + i, 17, 42, 99, 7 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert sum(leased) > len(live) // 2
    hist = core.stats.draft_k_histogram
    assert sum(hist.values()) == sum(live) and hist[0] > sum(live) // 2


def _pin_clock(policy, forward_s, draft_s: float) -> None:
    """Feed `policy` synthetic seconds in place of measured ones: `forward_s(rows)` a
    forward, `draft_s` a drafted token (the catch-up's tokens included)."""
    observe_step, observe_draft, leased_step = (policy.observe_step, policy.observe_draft,
                                                policy.leased_step)
    policy.observe_step = lambda rows, seconds, windows=None: observe_step(
        rows, forward_s(rows), windows)
    policy.observe_draft = lambda depth, seconds, catch_ups=None: observe_draft(
        depth, draft_s * (depth + sum(catch_ups or [])), catch_ups)
    policy.leased_step = lambda request_ids, seconds: leased_step(
        request_ids, forward_s(len(request_ids or [])))


def test_speculating_steps_feed_the_realized_check_and_the_stats():
    """Steps run as the policy chose them reach the realized check with the tokens they
    emitted (one and the accepted drafts) and the seconds of their forward and drafting;
    the factor its choices applied is in the engine's stats. (The policy is told that
    every draft is accepted and that a forward costs 1 ms + 10 us a row and drafting
    0.1 ms a token, so that its choices do not depend on this machine's speed: with
    measured times a slow phase turned speculation off after 4 steps.)"""
    import numpy as np
    plain = LLM("tiny-moe", dtype="float32")
    spec = plain.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                   "num_speculative_tokens": 4, "policy": "adaptive"})
    policy = spec.engine.policy
    policy.acceptance.rates = lambda request_id: np.ones(4)
    _pin_clock(policy, forward_s=lambda rows: 1e-3 + 1e-5 * rows, draft_s=1e-4)
    seen = []
    observe_on = policy.realized.observe_on
    policy.realized.observe_on = lambda *a: seen.append(a) or observe_on(*a)
    prompts = [[5 + i, 17, 42, 99, 7 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    got = [spec.generate([p], params)[0].token_ids for p in prompts]  # one request
    assert got == expected
    assert len(seen) >= 8
    for batch, tokens, seconds, p_tokens, p_seconds in seen:
        assert batch == 1 and 1 <= tokens <= 5 and seconds > 0
        assert 1 < p_tokens <= 5 and p_seconds > 0
    factors = spec.engine.stats.to_dict()["realized_gain_factors"]
    assert set(factors) == {1} and 0 < factors[1] <= 1
    spec.engine.reset_stats()  # counters zeroed, the policy's state kept (as the bench)
    assert spec.engine.stats.num_steps == 0
    assert spec.engine.stats.to_dict()["realized_gain_factors"] == factors
