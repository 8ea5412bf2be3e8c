"""Greedy speculation on SmolLM2-135M quantised to int4 (bf16 activations, our int4 kernel):
the reproduction of a divergence from plain decoding at a near-tie (prompt lookup, K = 4,
"The capital of France is": plain ' Paris.\\n\\nThe answer is: 23', speculative ' Paris.\\n\\n
The city of Paris is the capital of'; tokens 0-4 alike, the top two swap at token 5).

It runs only where the int4 kernel runs (x86-64 with AVX-512) and is expected to fail there
until the op whose bits change with the forward's rows is found; the warning says so
meanwhile (`layers.quantization.UNEXPLAINED_INT4_DIVERGENCE`). Not strict: the machine kinds
that run it have not all shown the divergence.
"""

from __future__ import annotations

import pytest
from kernel_checks import require_kernel

from specmoe import LLM, SamplingParams
from specmoe.kernels import attention, gemv, gemv_int4


@pytest.mark.xfail(reason="greedy int4 speculation diverged from plain decoding on SmolLM2 "
                          "at a near-tie; cause not yet found", strict=False)
@pytest.mark.parametrize("k", [1, 4, 8])
def test_int4_greedy_speculation_equals_plain(smollm2, k):
    require_kernel("int4 kernel", gemv_int4.kernel_unavailable_reason())
    require_kernel("bf16 linear kernel", gemv.kernel_unavailable_reason())
    require_kernel("attention kernel", attention.kernel_unavailable_reason())
    llm = LLM(smollm2, dtype="bfloat16", quantization="int4",
              speculative={"method": "ngram", "num_speculative_tokens": k})
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
               "The three primary colors are", "Once upon a time", "1, 2, 3, 4,",
               "The largest planet in the solar system is", "import numpy as np\n"]
    for prompt in prompts:
        plain, spec = (llm.generate(prompt, SamplingParams(
            temperature=0, max_tokens=12, num_speculative_tokens=n))[0] for n in (0, k))
        assert spec.token_ids == plain.token_ids, prompt
