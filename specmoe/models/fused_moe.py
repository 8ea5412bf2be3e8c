"""The sparse MoE block's part of the fused decoder driver's layer table
(`specmoe.models.fused_layers`): which `SparseMoEBlock`s the driver runs as the modules do,
the tensors it reads from them, and their C `Moe` record.

The driver computes a MoE block as `SparseMoEBlock.forward` does on bf16 CPU: the router's
gate through the linear kernel, the routing through the router kernel that `TopKRouter`
itself calls (`specmoe.kernels.router`: softmax in fp32, top-k with the lower-id tie rule,
`norm_topk_prob`), the routed experts through the fused MoE kernel that the "fused" backend
calls (`RoutedExperts.forward_fused`) or, for int4 `QuantizedRoutedExperts`, the fused int4
MoE kernel that their `forward` calls (`specmoe.kernels.moe_int4`, every backend but
"reference"), the shared expert through the linear (bf16, or int4 for `Int4Linear`
projections) and SiLU-and-mul kernels and its sigmoid gate as torch.sigmoid rounds it. So
it takes a block only where the modules take exactly those kernels: the "fused" backend on
bf16 experts whose intermediate size is a multiple of 16, or int4 quantised experts (not
int8: torch's kernel) on our int4 layout, a router the router kernel takes, bf16 `Linear`
gates and a `GatedMLP` shared expert whose projections are bf16 `Linear`s or `Int4Linear`s
on our int4 kernel, and no expert-stats recorder (`NullExpertStats`: the driver hands no
routing back to Python, so a recorder makes the block run as modules, which record).
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import decoder, gemv_int4, moe, moe_int4, router
from specmoe.layers.linear import Linear
from specmoe.layers.mlp import GatedMLP
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.layers.moe.router import TopKRouter
from specmoe.layers.moe.stats import NullExpertStats
from specmoe.layers.quantization import Int4Linear, QuantizedRoutedExperts

BF16 = torch.bfloat16
PER_MOE = 10  # sources per MoE block: 4 x (weights, bias) with the experts' 2 packed copies
# (int4 experts: their `moe_int4.Int4Experts`, None)


def plain_moe(block) -> bool:
    """A `SparseMoEBlock` the driver computes as its modules do (see the module docstring);
    shapes and dtypes are checked by `moe_sources`."""
    experts = block.experts
    if not (type(block) is SparseMoEBlock and type(block.router) is TopKRouter
            and block.router.is_softmax_topk
            and type(experts) in (RoutedExperts, QuantizedRoutedExperts)
            and type(block.stats) is NullExpertStats):
        return False
    run = block.run_experts
    if getattr(run, "__self__", None) is not experts:
        return False
    if type(experts) is QuantizedRoutedExperts:
        # "fused", "grouped" and "grouped_mm" all bind `forward`, the one int4 call
        if getattr(run, "__func__", None) is not QuantizedRoutedExperts.forward or \
                experts.method != "int4":
            return False
    elif getattr(run, "__func__", None) is not RoutedExperts.forward_fused or \
            not experts.reads_packed:
        return False
    shared, gate = block.shared_expert, block.shared_expert_gate
    return ((shared is None or type(shared) is GatedMLP)
            and (gate is None or (shared is not None and type(gate) is Linear)))


def moe_modules(block) -> list:
    """The modules whose hooks or per-instance forwards the driver would skip."""
    mods = [block, block.router, block.router.gate, block.experts]
    if block.shared_expert is not None:
        s = block.shared_expert
        mods += [s, s.gate_up_proj, s.down_proj]
    if block.shared_expert_gate is not None:
        mods.append(block.shared_expert_gate)
    return mods


def _linear(m, shape: tuple[int, int]) -> tuple | None:
    """(packed weights, bias) of a bf16 `Linear` of weight shape `shape`, else None."""
    if type(m) is not Linear:
        return None
    w = m.weight
    if w.dtype is BF16 and (w.is_cpu or w.is_meta) and tuple(w.shape) == shape:
        return m.weight_panels.get(w), m.bias
    return None


def _shared_linear(m, shape: tuple[int, int]) -> tuple | None:
    """A shared-expert projection of weight shape `shape` as the driver reads it: a bf16
    `Linear`'s (packed weights, bias), an `Int4Linear`'s (`Int4Weights`, None) (bias
    inside), else None."""
    if type(m) is Int4Linear:
        k = m.cpu_kernel
        return None if k is None or (k.num_out, k.num_in) != shape else (k, None)
    return _linear(m, shape)


def _experts_sources(experts, n: int, k: int, hidden: int) -> list | None:
    """The routed experts as the driver reads them: bf16 experts' packed w13 and w2, int4
    ones' (`Int4Experts`, None); None where the driver does not run them (also their
    kernels unavailable)."""
    if not router.applies_to(n, k):
        return None
    if type(experts) is QuantizedRoutedExperts:
        fused = experts._fused_experts()
        if fused is None or fused.hidden_size != hidden or not decoder.moe_int4_available():
            return None
        return [fused, None]
    i = experts.intermediate_size
    w13, w2 = experts.w13, experts.w2
    if not (w13.dtype is BF16 is w2.dtype and (w13.is_cpu or w13.is_meta)
            and (w2.is_cpu or w2.is_meta) and i % 16 == 0 and i > 0
            and tuple(w13.shape) == (n, 2 * i, hidden) and tuple(w2.shape) == (n, hidden, i)
            and decoder.moe_available()):
        return None
    try:
        return [moe._packed(experts.w13_panels, w13, "w13"),
                moe._packed(experts.w2_panels, w2, "w2")]
    except (ValueError, RuntimeError):
        return None


def moe_sources(block, hidden: int) -> list | None:
    """The block's tensors as the driver reads them: (weights, bias) of the router gate,
    the experts' (`_experts_sources`), (weights, bias) of the shared expert's gate/up and
    down projections (`_shared_linear`) and of its gate (None, None where absent); None
    when the driver does not run the block (see the module docstring; also the kernels
    unavailable)."""
    experts, rt = block.experts, block.router
    n, k = experts.num_experts, rt.top_k
    routed = _experts_sources(experts, n, k, hidden)
    gate = _linear(rt.gate, (n, hidden))
    if routed is None or gate is None:
        return None
    out = [*gate, *routed]
    if block.shared_expert is None:
        return out + [None] * 6
    s = block.shared_expert
    si = _shared_intermediate(block)
    parts = [_shared_linear(s.gate_up_proj, (2 * si, hidden)),
             _shared_linear(s.down_proj, (hidden, si))]
    if block.shared_expert_gate is not None:
        parts.append(_linear(block.shared_expert_gate, (1, hidden)))
    if si % 16 or si == 0 or any(p is None for p in parts):
        return None
    if any(isinstance(p[0], gemv_int4.Int4Weights) for p in parts) and \
            not decoder.int4_available():
        return None
    out += [t for p in parts for t in p]
    return out + [None] * (PER_MOE - len(out))


def _shared_intermediate(block) -> int:
    """The shared expert's intermediate size (its down projection's inputs; 0: none)."""
    if block.shared_expert is None:
        return 0
    down = block.shared_expert.down_proj
    if type(down) is Int4Linear:
        return 0 if down.cpu_kernel is None else down.cpu_kernel.num_in
    return down.weight.shape[-1]


def bias_sizes(block, hidden: int) -> tuple[int, ...]:
    """The sizes of the biases among `moe_sources` (router gate, shared gate/up, shared
    down, shared gate)."""
    return block.experts.num_experts, 2 * _shared_intermediate(block), hidden, 1


def weights_released(block) -> bool:
    """Whether every dense weight the driver reads packed was released to the meta device
    (then in-place edits cannot change them behind the table's back). int4 experts and
    projections count as released: the driver reads their buffers in place, no copy."""
    lins = [m for m in moe_modules(block) if type(m) is Linear]
    experts = block.experts
    routed = type(experts) is QuantizedRoutedExperts or (experts.w13.is_meta
                                                         and experts.w2.is_meta)
    return routed and all(m.weight.is_meta for m in lins)


def _lin(weights, bias) -> decoder.Lin:
    if weights is None:
        return decoder.Lin(None, None, 0)
    if isinstance(weights, gemv_int4.Int4Weights):
        return decoder.Lin(ctypes.addressof(weights._c), None, 1)
    return decoder.Lin(weights.data_ptr(), None if bias is None else bias.data_ptr(), 0)


def build_moe(block, sources: list) -> decoder.Moe:
    """The C record of a block from its `moe_sources` (the table's sources list keeps the
    `Int4Experts` and `Int4Weights` it points into alive)."""
    experts, routed = block.experts, sources[2]
    if isinstance(routed, moe_int4.Int4Experts):
        w13, w2, int4 = ctypes.addressof(routed.w13), ctypes.addressof(routed.w2), 1
    else:
        w13, w2, int4 = routed.data_ptr(), sources[3].data_ptr(), 0
    return decoder.Moe(
        _lin(*sources[0:2]), w13, w2, experts.num_experts, block.router.top_k,
        experts.intermediate_size, int(bool(block.router.norm_topk_prob)),
        _lin(*sources[4:6]), _lin(*sources[6:8]), _lin(*sources[8:10]),
        _shared_intermediate(block), int4)
