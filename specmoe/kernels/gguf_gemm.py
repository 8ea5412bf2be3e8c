"""Matrix products and embedding lookups on GGUF-quantised weights in the file's own blocks,
through `gguf_gemm.c` and `gguf_dot.h` (the C sources give the method): a weight W [n, k]
of ggml type Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K stays as its `row_bytes`
bytes per row, so a forward reads the file's bytes, as llama.cpp does.

Products multiply the weights' exact values (those `gguf.quants.dequantize` gives for the
blocks, `dequantize_reference`) by the activations rounded to int8 per block of
`activation_block(type)` inputs (scale max|x| / 127, round half to even), as llama.cpp's
CPU kernels do: per output, the rounding errs by at most sum over blocks of
scale / 2 * sum |w| of the block. `quantize_activations` is that rounding in plain torch
and `matmul_reference` the whole product. Each output row's sum has one order whatever the
number of rows (batch invariant), so greedy speculation on a GGUF target equals plain
decoding. Lookups (`rows`) give the exact values.

`GGUFWeight` holds one tensor's blocks; `matmul` runs the kernel where it applies (a CPU
with AVX2/FMA/F16C, the kernels' switch on: `specmoe.kernels.set_enabled`) and
`matmul_reference` everywhere else.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from specmoe.kernels import gemv
from specmoe.kernels.build import LazyKernel, load

Q = gguf.GGMLQuantizationType
NATIVE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
_ERRORS = {-1: "unknown type", -2: "k is not a multiple of the block",
           -3: "row_bytes does not match k", -4: "out of memory", -6: "top_k above 64"}


def load_kernel():
    """Build and load `gguf_gemm.c`; returns the library (`specmoe_gguf_gemm`,
    `specmoe_gguf_dequant_rows`).

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load("gguf_gemm.c", extra_flags=("-ffp-contract=off",), cpu_flags=_REQUIRED_CPU_FLAGS)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specmoe_gguf_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr,
                                      i64, ctypes.c_int]
    lib.specmoe_gguf_dequant_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr,
                                              ctypes.c_int]
    lib.specmoe_gguf_moe.argtypes = [ptr, i64, i64, ptr, ptr, i64, ctypes.c_int, ptr, i64, i64,
                                     ctypes.c_int, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.specmoe_gguf_gemm.restype = lib.specmoe_gguf_dequant_rows.restype = ctypes.c_int
    lib.specmoe_gguf_moe.restype = ctypes.c_int
    return lib


_lazy = LazyKernel(load_kernel, "GGUF block kernel unavailable, dequantising per call")


def kernel():
    """The loaded library, or None (kernels off, CPU without AVX2/FMA/F16C, no compiler)."""
    return _lazy.get() if gemv.is_enabled() else None


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k weights of `ggml_type`.

    Raises:
        ValueError: k is not a multiple of the type's block size.
    """
    block, size = gguf.GGML_QUANT_SIZES[Q(ggml_type)]
    if k % block:
        raise ValueError(f"{Q(ggml_type).name} rows hold multiples of {block} weights, not {k}")
    return k // block * size


@dataclass
class GGUFWeight:
    """One weight W [n, k] (or a stack [E, n, k] of experts' weights) as GGUF blocks.

    Attributes:
        ggml_type: a `gguf.GGMLQuantizationType` in NATIVE_TYPES.
        blocks: uint8 [n, row_bytes] (or [E, n, row_bytes]), on the CPU.
        in_features: k.
    """

    ggml_type: int
    blocks: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if Q(self.ggml_type) not in NATIVE_TYPES:
            raise ValueError(f"GGUF type {Q(self.ggml_type).name} has no native kernel; "
                             f"native: {sorted(t.name for t in NATIVE_TYPES)}")
        expected = row_bytes(self.ggml_type, self.in_features)
        if self.blocks.dtype != torch.uint8 or self.blocks.shape[-1] != expected:
            raise ValueError(f"{Q(self.ggml_type).name} blocks for k={self.in_features} must "
                             f"be uint8 [..., {expected}], got {self.blocks.dtype} "
                             f"{tuple(self.blocks.shape)}")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[-2]

    def expert(self, e: int) -> "GGUFWeight":
        """Expert e's weight of a stack (a view, no copy)."""
        return GGUFWeight(self.ggml_type, self.blocks[e], self.in_features)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self) -> torch.Tensor:
        """W [n, k] (or [E, n, k]) float32 with the file's values (`dequantize_reference`
        through the kernel where it runs)."""
        lib = kernel()
        if lib is None or self.blocks.dim() != 2:
            return dequantize_reference(self)
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [m]) of W as float32 [m, k] (an embedding lookup).

        Raises:
            IndexError: an id outside [0, n).
        """
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"row ids must lie in [0, {self.out_features}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        lib = kernel()
        if lib is None or not self.blocks.is_cpu:
            return dequantize_reference(self)[ids]
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        _check(lib.specmoe_gguf_dequant_rows(
            int(self.ggml_type), self.blocks.data_ptr(), self.blocks.stride(0),
            self.in_features, ids.data_ptr(), ids.numel(), out.data_ptr(),
            torch.get_num_threads()))
        return out

    def matmul_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """out[:, :n] = x @ W^T through the kernel; False (out untouched) where it does not
        apply. x: float32 [T, k] with unit stride in rows; out: float32 [T, >= n] likewise.
        """
        lib = kernel()
        if (lib is None or not x.is_cpu or self.blocks.dim() != 2 or x.dtype != torch.float32
                or out.dtype != torch.float32 or x.stride(-1) != 1 or out.stride(-1) != 1
                or not self.blocks.is_contiguous()):
            return False
        _check(lib.specmoe_gguf_gemm(
            int(self.ggml_type), self.blocks.data_ptr(), self.blocks.stride(0),
            self.out_features, self.in_features, x.data_ptr(), x.stride(0), x.shape[0],
            out.data_ptr(), out.stride(0), torch.get_num_threads()))
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, k] (any float dtype) @ W^T -> [T, n] float32: the kernel where it applies,
        else `matmul_reference`."""
        xf = x.to(torch.float32).contiguous()
        out = torch.empty(xf.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        if xf.shape[0] == 0 or self.matmul_into(xf, out):
            return out
        return self.matmul_reference(x)

    def matmul_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch: x rounded as the kernel rounds it (`quantize_activations`) @
        dequantize_reference(W)^T in float32."""
        w = dequantize_reference(self).to(x.device)
        return F.linear(quantize_activations(x, activation_block(self.ggml_type)), w)


def try_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            gate_up: GGUFWeight, down: GGUFWeight) -> torch.Tensor | None:
    """A MoE layer's routed SwiGLU experts in one kernel call, or None where it does not
    apply (kernel unavailable, not CPU). gate_up: stack [N, 2I, H] (gate rows first);
    down: stack [N, H, I]; x [T, H]; topk_ids [T, k] int64; topk_weights [T, k]. Returns
    float32 [T, H]: per token, its experts' weighted outputs added in float32 in ascending
    expert order; each product as `GGUFWeight.matmul` computes it.

    Raises:
        IndexError: an expert id outside [0, N).
    """
    lib = kernel()
    if lib is None or not x.is_cpu or gate_up.blocks.dim() != 3:
        return None
    xf = x.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(xf.shape, dtype=torch.float32)
    gu, dn = gate_up.blocks, down.blocks
    code = lib.specmoe_gguf_moe(
        xf.data_ptr(), xf.shape[0], xf.shape[1], ids.data_ptr(), weights.data_ptr(),
        ids.shape[1], int(gate_up.ggml_type), gu.data_ptr(), gu.stride(0), gu.stride(1),
        int(down.ggml_type), dn.data_ptr(), dn.stride(0), dn.stride(1), gu.shape[0],
        down.in_features, out.data_ptr(), torch.get_num_threads())
    if code == -5:
        raise IndexError(f"expert ids must lie in [0, {gu.shape[0]})")
    _check(code)
    return out


def activation_block(ggml_type: int) -> int:
    """Inputs per int8 activation scale for weights of `ggml_type`: 256 for the K-quants
    (their super-block), 32 otherwise."""
    return 256 if gguf.GGML_QUANT_SIZES[Q(ggml_type)][0] == 256 else 32


def quantize_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [T, k] (k % block == 0) rounded as the kernel rounds it, as float32 values: per
    block, scale = max|x| / 127 and round-half-even(x * (1 / scale)) * scale (0 for an
    all-zero block)."""
    xb = x.to(torch.float32).reshape(x.shape[0], -1, block)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(xb * inv) * scale).reshape(x.shape[0], -1)


def _check(code: int) -> None:
    if code != 0:
        raise RuntimeError(f"GGUF kernel failed: {_ERRORS.get(code, code)}")


def dequantize_reference(weight: GGUFWeight) -> torch.Tensor:
    """The weight's values as the `gguf` package decodes its blocks (`gguf.quants.dequantize`):
    float32 [..., n, k]."""
    blocks = weight.blocks.cpu().numpy()
    values = gguf.quants.dequantize(blocks, Q(weight.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
