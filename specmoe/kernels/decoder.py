"""A run of decoder layers in one native call, bf16 on CPU, through `decoder_bf16.c`.

The C driver calls the linear (bf16 `gemv`, or `gemv_int4` for int4 projections), RMSNorm,
RoPE, SiLU-and-mul and attention kernels (`elementwise`, `attention`) layer after layer,
and for a sparse MoE layer the router (`router`: softmax top-k) and the fused experts
(`moe`, or `moe_int4` for int4 experts), with the arguments the Python modules pass them,
so its output has the same bits as the modules'. It saves the Python dispatch between
them, a share of every decode step that grows as the model gets smaller (most for a small
int4 draft model).
`specmoe.models.fused_layers` builds the tables from a model; its test checks the bits
against the module path.
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import attention, elementwise, gemv, gemv_int4, moe, moe_int4, router
from specmoe.kernels.build import LazyKernel, load

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Kernels(ctypes.Structure):
    """The kernels' addresses (C `Kernels`)."""
    _fields_ = [(name, _P) for name in ("linear", "linear_int4", "rms_norm", "rotary",
                                        "silu_and_mul", "attention", "route", "moe",
                                        "sigmoid", "moe_int4")]


class Dims(ctypes.Structure):
    """Sizes every layer shares and the RoPE tables (C `Dims`)."""
    _fields_ = [(name, _I) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                        "intermediate", "max_position")] + [
        ("eps", _F), ("scale", _F), ("cos_table", _P), ("sin_table", _P)]


class Lin(ctypes.Structure):
    """A projection (C `Lin`): packed bf16 weights and bias (NULL: none), or with `int4`
    set the address of an int4 kernel's `struct specmoe_int4_weights` (bias inside)."""
    _fields_ = [("w", _P), ("bias", _P), ("int4", _I)]


PROJECTIONS = ("qkv", "o", "gate_up", "down")


class Moe(ctypes.Structure):
    """A sparse MoE block (C `Moe`): the router's gate, the experts' weights (bf16: the
    packed w13 and w2; `int4` set: the addresses of `moe_int4.Int4Experts`' two
    `struct specmoe_int4_weights`), sizes, and the shared expert and its gate (`Lin` with w
    None: absent)."""
    _fields_ = [("gate", Lin), ("w13", _P), ("w2", _P)] + [
        (name, _I) for name in ("num_experts", "top_k", "intermediate", "norm_topk_prob")] + [
        (name, Lin) for name in ("shared_gate_up", "shared_down", "shared_gate")] + [
        ("shared_intermediate", _I), ("int4", _I)]


class Layer(ctypes.Structure):
    """One layer's norm weights, projections, MoE block (None: a dense MLP) and KV cache
    (C `Layer`)."""
    _fields_ = [(name, _P) for name in ("input_norm", "post_attn_norm", "q_norm", "k_norm")] + [
        (name, Lin) for name in PROJECTIONS] + [
        ("moe", ctypes.POINTER(Moe)), ("k_cache", _P), ("v_cache", _P)]


class Step(ctypes.Structure):
    """One forward's rows, sequences and scratch buffers (C `Step`)."""
    _fields_ = [("x", _P), ("T", _I)] + [(name, _P) for name in (
        "positions", "slots", "row_start", "num_rows", "start_pos", "block_tables")] + [
        (name, _I) for name in ("num_seqs", "max_blocks", "block_size", "window")] + [
        (name, _P) for name in ("h", "qkv", "q", "attn", "gate_up", "act", "logits",
                                "topk_ids", "topk_weights", "moe_out", "shared_out",
                                "shared_gate", "shared_scale", "moe_scratch")]


class MoeSizes:
    """What a step's MoE scratch must hold, the largest over the MoE layers: experts N,
    top-k k, routed intermediate size, shared-expert intermediate size (0: none); and which
    kernels they call: `bf16` / `int4` (any layer with bf16 / int4 routed experts),
    `int4_linear` (any int4 shared-expert projection: at most `gemv_int4.MAX_ROWS` rows)."""

    def __init__(self, layers) -> None:
        moes = [lay.moe.contents for lay in layers if lay.moe]
        self.any = bool(moes)
        self.bf16 = any(not m.int4 for m in moes)
        self.int4 = any(m.int4 for m in moes)
        self.int4_linear = any(lin.int4 for m in moes
                               for lin in (m.shared_gate_up, m.shared_down, m.shared_gate))
        self.num_experts = max((m.num_experts for m in moes), default=0)
        self.top_k = max((m.top_k for m in moes), default=0)
        self.intermediate = max((m.intermediate for m in moes), default=0)
        self.shared_intermediate = max((m.shared_intermediate for m in moes), default=0)


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
    # the int4 kernel and the MoE ones: see int4_available and moe_available
    return fn, Kernels(addr[0], None, *addr[1:])


_lazy = LazyKernel(load_driver, "fused decoder driver unavailable, running layer by layer")

STEPS = ("input norm", "QKV projection", "RoPE", "attention", "output projection",
         "post-attention norm", "gate/up projection", "SiLU-and-mul", "down projection",
         "q/k norm", "router gate", "routing", "routed experts", "shared expert",
         "shared-expert gate")


def available() -> bool:
    """Whether the kernels are on and the driver is built and loaded (building it now if
    needed)."""
    return gemv.is_enabled() and _lazy.get() is not None


def int4_available() -> bool:
    """Whether the driver can call the int4 kernel, loading it now for the driver if
    needed (only models with int4 projections ask)."""
    loaded = _lazy.get()
    if loaded is None:
        return False
    kernels = loaded[1]
    if kernels.linear_int4 is None:
        fn = gemv_int4._lazy.get()
        kernels.linear_int4 = None if fn is None else ctypes.cast(fn, _P).value
    return kernels.linear_int4 is not None


def moe_available() -> bool:
    """Whether the driver can call the router and fused MoE kernels, loading them now for
    the driver if needed (only MoE models ask)."""
    loaded = _lazy.get()
    if loaded is None:
        return False
    kernels = loaded[1]
    if kernels.moe is None:
        lib, fn = router.library(), moe._lazy.get()
        if lib is None or fn is None:
            return False
        kernels.route = ctypes.cast(lib.specmoe_route_softmax_bf16, _P).value
        kernels.sigmoid = ctypes.cast(lib.specmoe_sigmoid_bf16, _P).value
        kernels.moe = ctypes.cast(fn, _P).value
    return True


def moe_int4_available() -> bool:
    """Whether the driver can call the router and the fused int4 MoE kernels, loading
    them now for the driver if needed (only models with int4 experts ask)."""
    if not moe_available():
        return False
    kernels = _lazy.get()[1]
    if kernels.moe_int4 is None:
        fn = moe_int4._lazy.get()
        kernels.moe_int4 = None if fn is None else ctypes.cast(fn, _P).value
    return kernels.moe_int4 is not None


def moe_scratch_bytes(sizes: MoeSizes, t: int, hidden: int) -> int:
    """Bytes of MoE scratch a step of t rows needs: the largest layer's, for the kernels
    its MoE layers call (0 without MoE layers; the kernels must be loaded)."""
    args = (t, sizes.top_k, hidden, sizes.intermediate, sizes.num_experts)
    need = moe.scratch_bytes(*args) if sizes.bf16 else 0
    return max(need, moe_int4.scratch_bytes(*args)) if sizes.int4 else need


def run_layers(dims: Dims, layers: ctypes.Array, x: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, seqs, window: int, sizes: MoeSizes | None = None) -> None:
    """Run `layers` over the residual stream x in place.

    Args:
        dims: the model's sizes and RoPE tables.
        layers: a ctypes array of `Layer`.
        x: [T, hidden] bfloat16 CPU contiguous; updated in place.
        positions, slots: [T] int64 CPU contiguous: each row's position and KV cache slot.
        seqs: a `specmoe.layers.paged_attention.KernelSequences` covering the T rows.
        window: sliding window in tokens, 0 for none.
        sizes: `MoeSizes(layers)` (computed here if None).
    The caller has checked what the kernels check (dtypes, contiguity, head_dim, positions
    within the RoPE tables, at most `gemv_int4.MAX_ROWS` rows for int4 projections,
    `moe_available()` for MoE layers, `moe_int4_available()` for int4 ones;
    `specmoe.models.fused_layers` does).
    Raises:
        RuntimeError: the driver is unavailable, or a kernel refused its arguments or ran
            out of memory for its work space (naming the layer and step; the layers before
            it have run).
    """
    loaded = _lazy.get()
    if loaded is None:
        raise RuntimeError(f"fused decoder driver unavailable: {_lazy.unavailable}")
    fn, kernels = loaded
    t = x.shape[0]
    qn, kvn = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    sizes = MoeSizes(layers) if sizes is None else sizes
    inter = max(dims.intermediate, sizes.shared_intermediate)
    bufs = [torch.empty(t, n, dtype=torch.bfloat16) for n in (
        dims.hidden, qn + 2 * kvn, qn, qn, 2 * inter, inter)]
    if sizes.any:
        n, k, h = sizes.num_experts, sizes.top_k, dims.hidden
        scratch = moe_int4.scratch_buffer(moe_scratch_bytes(sizes, t, h)) if sizes.int4 \
            else moe.scratch_for(t, k, h, sizes.intermediate, n)
        bufs += [torch.empty(t, n, dtype=torch.bfloat16), torch.empty(t, k, dtype=torch.int64),
                 torch.empty(t, k, dtype=torch.bfloat16), torch.empty(t, h, dtype=torch.bfloat16),
                 torch.empty(t, h, dtype=torch.bfloat16), torch.empty(t, dtype=torch.bfloat16),
                 torch.empty(t, dtype=torch.bfloat16), scratch]
        ptrs = [b.data_ptr() for b in bufs]
    else:
        ptrs = [b.data_ptr() for b in bufs] + [None] * 8
    tables = seqs.block_tables
    step = Step(x.data_ptr(), t, positions.data_ptr(), slots.data_ptr(),
                seqs.row_start.data_ptr(), seqs.num_rows.data_ptr(), seqs.start_pos.data_ptr(),
                tables.data_ptr(), tables.shape[0], tables.shape[1], seqs.block_size, window,
                *ptrs)
    rc = fn(ctypes.byref(kernels), ctypes.byref(dims), layers, len(layers), ctypes.byref(step),
            torch.get_num_threads())
    if rc:
        layer, what = divmod(-rc, 32)
        raise RuntimeError(f"fused decoder: the {STEPS[what - 1]} kernel of layer {layer} "
                           f"refused its arguments")
