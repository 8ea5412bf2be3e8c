"""A run of dense decoder layers in one native call, bf16 on CPU, through `decoder_bf16.c`.

The C driver calls the linear, RMSNorm, RoPE, SiLU-and-mul and attention kernels
(`gemv`, `elementwise`, `attention`) layer after layer, with the arguments the Python modules
pass them, so its output has the same bits as the modules'; it saves the Python dispatch
between them, ~2 ms of a 40 ms decode step of a 28-layer model (see
`specmoe.models.fused_layers`, which builds the tables from a model, and its test against
the module path).
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import attention, elementwise, gemv
from specmoe.kernels.build import LazyKernel, load

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Kernels(ctypes.Structure):
    """The kernels' addresses (C `Kernels`)."""
    _fields_ = [(name, _P) for name in ("linear", "rms_norm", "rotary", "silu_and_mul",
                                        "attention")]


class Dims(ctypes.Structure):
    """Sizes every layer shares and the RoPE tables (C `Dims`)."""
    _fields_ = [(name, _I) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                        "intermediate", "max_position")] + [
        ("eps", _F), ("scale", _F), ("cos_table", _P), ("sin_table", _P)]


LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_attn_norm", "gate_up",
                "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")


class Layer(ctypes.Structure):
    """One layer's weight and KV cache addresses (C `Layer`; NULL for an absent bias)."""
    _fields_ = [(name, _P) for name in LAYER_FIELDS]


class Step(ctypes.Structure):
    """One forward's rows, sequences and scratch buffers (C `Step`)."""
    _fields_ = [("x", _P), ("T", _I)] + [(name, _P) for name in (
        "positions", "slots", "row_start", "num_rows", "start_pos", "block_tables")] + [
        (name, _I) for name in ("num_seqs", "max_blocks", "block_size", "window")] + [
        (name, _P) for name in ("h", "qkv", "q", "attn", "gate_up", "act")]


def load_driver():
    """Build and load the driver and the kernels it calls; returns (driver function,
    Kernels).

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or a build failed.
        OSError: a built library cannot be loaded.
    """
    parts = (gemv._lazy.get(), elementwise._lazy.get(), attention._lazy.get())
    if any(p is None for p in parts):
        raise OSError("a kernel the decoder driver calls is unavailable")
    linear, lib, attend = parts
    fn = load("decoder_bf16.c", cpu_flags=gemv.REQUIRED_CPU_FLAGS).specmoe_decoder_layers_bf16
    fn.argtypes = [_P, _P, _P, _I, _P, ctypes.c_int]
    fn.restype = ctypes.c_int
    addr = [ctypes.cast(f, _P).value for f in (
        linear, lib.specmoe_rms_norm_bf16, lib.specmoe_rotary_bf16,
        lib.specmoe_silu_and_mul_bf16, attend)]
    return fn, Kernels(*addr)


_lazy = LazyKernel(load_driver, "fused decoder driver unavailable, running layer by layer")

STEPS = ("input norm", "QKV projection", "RoPE", "attention", "output projection",
         "post-attention norm", "gate/up projection", "SiLU-and-mul", "down projection")


def available() -> bool:
    """Whether the kernels are on and the driver is built and loaded (building it now if
    needed)."""
    return gemv.is_enabled() and _lazy.get() is not None


def run_layers(dims: Dims, layers: ctypes.Array, x: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, seqs, window: int) -> None:
    """Run `layers` over the residual stream x in place.

    Args:
        dims: the model's sizes and RoPE tables.
        layers: a ctypes array of `Layer`.
        x: [T, hidden] bfloat16 CPU contiguous; updated in place.
        positions, slots: [T] int64 CPU contiguous: each row's position and KV cache slot.
        seqs: a `specmoe.layers.paged_attention.KernelSequences` covering the T rows.
        window: sliding window in tokens, 0 for none.
    The caller has checked what the kernels check (dtypes, contiguity, head_dim, positions
    within the RoPE tables; `specmoe.models.fused_layers` does).
    Raises:
        RuntimeError: the driver is unavailable, or a kernel refused its arguments (naming
            the layer and step; the layers before it have run).
    """
    loaded = _lazy.get()
    if loaded is None:
        raise RuntimeError(f"fused decoder driver unavailable: {_lazy.unavailable}")
    fn, kernels = loaded
    t = x.shape[0]
    qn, kvn = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    bufs = [torch.empty(t, n, dtype=torch.bfloat16) for n in (
        dims.hidden, qn + 2 * kvn, qn, qn, 2 * dims.intermediate, dims.intermediate)]
    tables = seqs.block_tables
    step = Step(x.data_ptr(), t, positions.data_ptr(), slots.data_ptr(),
                seqs.row_start.data_ptr(), seqs.num_rows.data_ptr(), seqs.start_pos.data_ptr(),
                tables.data_ptr(), tables.shape[0], tables.shape[1], seqs.block_size, window,
                *(b.data_ptr() for b in bufs))
    rc = fn(ctypes.byref(kernels), ctypes.byref(dims), layers, len(layers), ctypes.byref(step),
            torch.get_num_threads())
    if rc:
        layer, what = divmod(-rc, 16)
        raise RuntimeError(f"fused decoder: the {STEPS[what - 1]} kernel of layer {layer} "
                           f"refused its arguments")
