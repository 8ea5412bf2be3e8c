"""End to end on the real SmolLM2-135M in bfloat16 with the native CPU kernels: greedy
speculative decoding gives plain decoding's tokens exactly.

bf16 sums rounded in another order can flip a greedy near-tie, so this holds only because
every op of every forward is batch-invariant: the linear kernel (any number of rows) and the
attention kernel give a token the same bits whether it is decoded alone, verified with K
drafts beside other requests' drafts, computed in a chunked prefill or after a prefix-cache
hit. (fp32 is exact either way, see test_smollm2_speculative.py.)
"""

from __future__ import annotations

import pytest
from kernel_checks import require_kernel

from specmoe import LLM, SamplingParams
from specmoe.kernels import attention, gemv
from specmoe.utils.data import one_per_category

CATEGORIES = ("writing", "math", "coding")
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(smollm2) -> LLM:
    # Without the kernels bf16 outputs are not batch-invariant.
    require_kernel("bf16 linear kernel", gemv.kernel_unavailable_reason())
    require_kernel("attention kernel", attention.kernel_unavailable_reason())
    return LLM(smollm2, dtype="bfloat16")


@pytest.fixture(scope="module")
def prompts(plain) -> list[str]:
    questions = one_per_category("spec_bench", list(CATEGORIES))
    return [plain.chat_prompt([{"role": "user", "content": q.text}]) for q in questions]


def _generate(llm: LLM, prompt: str):
    llm.reset_prefix_cache()
    return llm.generate([prompt], GREEDY)[0]


@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
     "prompt_lookup_max": 3},
    {"method": "draft", "draft_model": "smollm2-135m", "num_speculative_tokens": 7},
], ids=["ngram-k4", "draft-k7"])
def test_bf16_greedy_speculation_equals_plain(plain, prompts, speculative):
    spec = plain.with_speculative(speculative)
    accepted = 0
    for prompt in prompts:
        expected = _generate(plain, prompt)
        out = _generate(spec, prompt)
        assert out.token_ids == expected.token_ids, prompt
        accepted += out.spec_stats.num_accepted_tokens
    assert accepted > 0, "nothing was accepted: the test would prove nothing"


def test_bf16_batches_chunks_and_prefix_hits_equal_plain_alone(plain, smollm2, prompts):
    """The prompts decoded alone, against: all of them in one batch with draft K=7 (one
    verification forward of up to 24 rows), the same again with their prompts in the prefix
    cache, and plain decoding with prefills chunked by a 48-token budget beside decodes."""
    expected = [_generate(plain, p).token_ids for p in prompts]
    spec = plain.with_speculative({"method": "draft", "draft_model": "smollm2-135m",
                                   "num_speculative_tokens": 7})
    spec.reset_prefix_cache()
    prefix = spec.engine.scheduler.kv_cache.block_pool.prefix_cache_stats
    for run in ("cold", "prefix hits"):
        hits = prefix.num_hit_tokens
        outs = spec.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected, run
    assert prefix.num_hit_tokens > hits, "the second run had no prefix-cache hit"
    chunked = LLM(smollm2, dtype="bfloat16", scheduler={"max_num_batched_tokens": 48})
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == expected
