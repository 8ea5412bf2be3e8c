"""The GGUF block kernel (`specmoe.kernels.gguf_gemm`) against the `gguf` package's
dequantisation: the very values of the file's blocks, sums within float32 accumulation
error, and each row's bits independent of the other rows and of the thread count."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from specmoe.kernels import gguf_gemm
from specmoe.kernels.build import cpu_reason
from specmoe.kernels.gguf_gemm import (
    NATIVE_TYPES,
    GGUFWeight,
    activation_block,
    dequantize_reference,
    quantize_activations,
)
from tests.gguf_blocks import random_blocks, random_weight

TYPES = sorted(NATIVE_TYPES)


@pytest.fixture(scope="module", autouse=True)
def built():
    """The kernel, or a skip where this machine cannot build it (a failure where it can)."""
    if gguf_gemm.kernel() is not None:
        return
    can = cpu_reason(gguf_gemm._REQUIRED_CPU_FLAGS) is None and shutil.which(
        os.environ.get("CC", "gcc"))
    reason = gguf_gemm._lazy.unavailable or "kernels switched off"
    if can and reason != "kernels switched off":
        pytest.fail(f"the GGUF kernel did not build on a machine that can build it: {reason}")
    pytest.skip(f"GGUF kernel unavailable: {reason}")


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 error bound of the kernel's x @ w^T: 4 * k * 2^-24 * sum |x| |w| per output
    (each block's scale products and the float sums of blocks, with margin)."""
    k = x.shape[1]
    return 4 * k * 2.0 ** -24 * (x.abs().double() @ w.abs().double().T)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (33, 1536)])
def test_the_file_values_and_the_products(ggml_type, n, k):
    w = random_weight(ggml_type, n, k, seed=n)
    ref = dequantize_reference(w)
    assert torch.equal(w.dequantize(), ref)
    ids = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(w.rows(ids), ref[ids])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(k))
    xq = quantize_activations(x, activation_block(ggml_type))
    got = w.matmul(x).double()
    assert ((got - xq.double() @ ref.double().T).abs() <= _bound(xq, ref)).all()
    # against the unrounded x: within the activations' rounding (half a step per input)
    step = (x - xq).abs().double().reshape(5, -1, activation_block(ggml_type)).amax(-1)
    rounding = step.repeat_interleave(activation_block(ggml_type), 1) @ ref.abs().double().T
    assert ((got - x.double() @ ref.double().T).abs() <= rounding + _bound(x, ref)).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_row_has_its_bits_alone_among_others_and_on_any_threads(ggml_type):
    w = random_weight(ggml_type, 70, 512, seed=3)
    x = torch.randn(80, 512, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = w.matmul(x)
        torch.set_num_threads(2)
        assert torch.equal(w.matmul(x), one_thread)
        for rows in (1, 2, 9, 17, 33):
            assert torch.equal(w.matmul(x[:rows]), one_thread[:rows])
        assert torch.equal(w.matmul(x[40:41]), one_thread[40:41])
    finally:
        torch.set_num_threads(threads)


def test_strided_output_and_bfloat16_input():
    w = random_weight(gguf_gemm.Q.Q4_K, 8, 256)
    x = torch.randn(3, 256)
    out = torch.full((3, 12), 7.0)
    assert w.matmul_into(x, out[:, 2:])
    assert torch.equal(out[:, 2:10], w.matmul(x)) and (out[:, :2] == 7).all() and (out[:, 10:] == 7).all()
    assert torch.equal(w.matmul(x.bfloat16()), w.matmul(x.bfloat16().float()))


def test_zero_rows_and_the_reference_agree():
    w = random_weight(gguf_gemm.Q.Q8_0, 4, 64)
    assert w.matmul(torch.zeros(0, 64)).shape == (0, 4)
    x = torch.randn(2, 64)
    torch.testing.assert_close(w.matmul(x), w.matmul_reference(x), rtol=1e-5, atol=1e-5)


def test_activations_round_as_the_kernel_rounds_them():
    """An activation already on the int8 grid of its block is not rounded: the product is
    then the exact one up to float32 sums."""
    w = random_weight(gguf_gemm.Q.Q6_K, 16, 512)
    x = quantize_activations(torch.randn(3, 512, generator=torch.Generator().manual_seed(5)), 256)
    assert torch.equal(quantize_activations(x, 256), x)
    ref = x.double() @ dequantize_reference(w).double().T
    assert ((w.matmul(x).double() - ref).abs() <= _bound(x, dequantize_reference(w))).all()


def test_bad_blocks_and_ids_are_named():
    blocks = torch.from_numpy(random_blocks(gguf_gemm.Q.Q4_0, 4, 64))
    with pytest.raises(ValueError, match="uint8"):
        GGUFWeight(int(gguf_gemm.Q.Q4_0), blocks[:, :-1], 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        GGUFWeight(int(gguf_gemm.Q.Q4_0), blocks, 60)
    with pytest.raises(ValueError, match="no native kernel"):
        GGUFWeight(int(gguf_gemm.Q.Q2_K), blocks, 64)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        GGUFWeight(int(gguf_gemm.Q.Q4_0), blocks, 64).rows(torch.tensor([4]))
