"""A MoE target drafting for itself with fewer routed experts (`--draft self:experts=K`):
greedy outputs stay those of plain decoding, the drafts are accepted often (the same weights),
the routers and the fused driver are put back after each drafting call, and bad settings
are refused with one line."""

from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams
from specmoe.config import SpeculativeConfig, parse_draft
from specmoe.layers.moe.backends import moe_blocks
from specmoe.models import fused_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5 + i, 17, 42, 99, 7 + i, 3, 17, 42] for i in range(5)]


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny-moe", dtype="float32")


@pytest.mark.parametrize("experts", [1, 2])
def test_greedy_self_drafting_is_lossless_and_accepted(plain, experts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    spec = plain.with_speculative({"method": "self", "self_draft_experts": experts,
                                   "num_speculative_tokens": 3})
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    drafted = sum(o.spec_stats.num_draft_tokens for o in outs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
    assert drafted > 0 and 0 < accepted <= drafted
    routers = [b.router for b in moe_blocks(plain.target.model)]
    assert {(r.top_k, r.norm_topk_prob) for r in routers} == {(4, False)}
    assert fused_layers.is_enabled()


def test_sampled_self_drafting_completes(plain):
    spec = plain.with_speculative({"method": "self", "self_draft_experts": 2})
    params = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=i)
              for i in range(len(PROMPTS))]
    outs = spec.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 16 and o.error is None for o in outs)


def test_a_dense_target_or_too_many_experts_is_refused(plain):
    with pytest.raises(ValueError, match="invalid self-draft experts=4: must be 1 to 3"):
        plain.with_speculative({"method": "self", "self_draft_experts": 4})
    dense = LLM("tiny-moe-draft", dtype="float32")
    with pytest.raises(ValueError, match="needs a MoE target"):
        dense.with_speculative({"method": "self", "self_draft_experts": 1})


@pytest.mark.parametrize("draft, fields", [
    ("ngram", {"method": "ngram"}),
    ("self:experts=2", {"method": "self", "self_draft_experts": 2}),
    ("tiny-moe-draft", {"method": "draft", "draft_model": "tiny-moe-draft"}),
])
def test_draft_values_name_their_method(draft, fields):
    assert parse_draft(draft) == fields


@pytest.mark.parametrize("draft", ["self:layers=0-3", "self:experts=", "self:experts=x"])
def test_bad_self_draft_values_are_refused(draft):
    with pytest.raises(ValueError, match="a self-draft is self:experts=K"):
        parse_draft(draft)


@pytest.mark.parametrize("fields, message", [
    ({"method": "self"}, "self_draft_experts=None"),
    ({"method": "ngram", "self_draft_experts": 2}, "method='ngram'"),
    ({"method": "self", "self_draft_experts": 0}, "invalid self_draft_experts=0"),
])
def test_bad_self_draft_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**fields)
