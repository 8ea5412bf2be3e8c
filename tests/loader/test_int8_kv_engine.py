"""End to end over an int8 KV cache on a GGUF model run at its own blocks (batch-invariant
kernels): greedy outputs alone equal those in a batch, with n-gram and draft speculation,
after prefix-cache hits and after preemption and recompute."""

from __future__ import annotations

import pytest
from test_gguf_blocks import _DENSE_TYPES, _dense_shapes, _write

from specmoe import LLM
from specmoe.kernels import attention, gguf_gemm
from specmoe.layers.int8_kv import Int8KV
from specmoe.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 70, 2, 11, 60], [4, 4, 4, 4, 4, 4, 4, 4, 4], [90, 3, 17, 90, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Every forward of at most 16 rows: all attention rows go through the int8 kernel.
SCHEDULER = {"kv_cache_dtype": "int8", "block_size": 4, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    for name, lazy in (("GGUF block", gguf_gemm._lazy), ("int8 attention", attention._lazy_int8)):
        if lazy.get() is None:
            pytest.skip(f"{name} kernel unavailable: {lazy.unavailable}")
    path = tmp_path_factory.mktemp("int8kv") / "qwen2.gguf"
    _write(path, "qwen2", _dense_shapes(), _DENSE_TYPES)
    return LLM(str(path), quantization="gguf", scheduler=SCHEDULER)


@pytest.fixture(scope="module")
def alone(llm):
    outs = []
    for prompt in PROMPTS:
        llm.reset_prefix_cache()
        outs.append(llm.generate([prompt], GREEDY)[0].token_ids)
    return outs


def test_the_cache_is_int8_and_a_batch_equals_each_prompt_alone(llm, alone):
    assert all(isinstance(layer, Int8KV) for layer in llm.engine.kv_cache.layers)
    arch = llm.target.arch
    per_token = arch.num_hidden_layers * 2 * arch.num_key_value_heads * (arch.head_dim + 4)
    assert f"KV cache: int8 (int8), {per_token} bytes per token" in llm.kv_cache_summary()
    llm.reset_prefix_cache()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone


def test_speculation_and_prefix_hits_equal_plain(llm, alone):
    path = llm.config.model.model
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "draft", "draft_model": path, "num_speculative_tokens": 3,
                  "draft_quantization": "gguf"}):
        engine = llm.with_speculative(spec)
        if spec["method"] == "draft":  # the draft's own cache follows the target's dtype
            assert all(isinstance(c, Int8KV) for c in engine.proposer.cache.layers)
        engine.reset_prefix_cache()
        prefix = engine.engine.scheduler.kv_cache.block_pool.prefix_cache_stats
        for run in ("cold", "prefix hits"):
            hits = prefix.num_hit_tokens
            outs = engine.generate(PROMPTS, GREEDY)
            assert [o.token_ids for o in outs] == alone, (spec["method"], run)
        assert prefix.num_hit_tokens > hits
        assert sum(o.spec_stats.num_accepted_tokens for o in outs) > 0


def test_preempted_requests_recompute_the_same_tokens(llm, alone):
    small = llm.with_speculative(None, num_kv_blocks=12)  # 3 requests need up to 24
    outs = small.generate(PROMPTS, GREEDY)
    assert small.engine.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
