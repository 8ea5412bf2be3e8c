"""GGUF blocks for tests: a weight of any natively run type, from the `gguf` package's
quantiser where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and from random bytes with small
finite fp16 scales for the K-quants (which it cannot write): every bit pattern of their
quantised values and 6-bit scales is a valid block."""

from __future__ import annotations

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
# byte ranges of each K-quant block's fp16 scales (d, and dmin where it has one)
_K_FP16 = {Q.Q4_K: (0, 4), Q.Q5_K: (0, 4), Q.Q6_K: (208, 210)}


def random_blocks(ggml_type: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes]: a random weight [n, k] as `ggml_type` blocks."""
    rng = np.random.default_rng(seed)
    t = Q(ggml_type)
    if t not in _K_FP16:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    lo, hi = _K_FP16[t]
    scales = rng.uniform(0.002, 0.02, size=(n, k // block, (hi - lo) // 2)).astype(np.float16)
    raw[:, :, lo:hi] = scales.view(np.uint8)
    return raw.reshape(n, -1)


def random_weight(ggml_type: int, n: int, k: int, seed: int = 0):
    """A `GGUFWeight` of random blocks (see `random_blocks`)."""
    from specmoe.kernels.gguf_gemm import GGUFWeight
    return GGUFWeight(int(ggml_type), torch.from_numpy(random_blocks(ggml_type, n, k, seed)), k)
