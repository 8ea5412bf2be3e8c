"""End to end on the real SmolLM2-135M in bfloat16 with the native CPU kernels: greedy
speculative decoding gives plain decoding's tokens exactly.

bf16 sums rounded in another order can flip a greedy near-tie, so this holds only because
every op of a decode or verification forward is batch-invariant: the linear kernel (up to
16 rows in a forward) and the attention kernel give a token the same bits whether it is
decoded alone or verified with K drafts. Every run starts with an empty prefix cache: a
prefix hit computes the prompt's tail with the decode kernels instead of the prefill matmul,
which is not bit-identical (so bf16 outputs after a hit may differ; fp32 is exact either way,
see test_smollm2_speculative.py).
"""

from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams
from specmoe.kernels import attention, gemv
from specmoe.utils.data import one_per_category

CATEGORIES = ("writing", "math", "coding")
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(smollm2) -> LLM:
    if gemv.kernel_unavailable_reason() is not None or not attention.available():
        pytest.skip("native CPU kernels unavailable: bf16 outputs are not batch-invariant")
    return LLM(smollm2, dtype="bfloat16")


@pytest.fixture(scope="module")
def prompts(plain) -> list[str]:
    try:
        questions = one_per_category("spec_bench", list(CATEGORIES))
    except FileNotFoundError as exc:
        pytest.skip(f"Spec-Bench prompts not found: {exc}")
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
