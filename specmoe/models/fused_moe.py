"""The sparse MoE block's part of the fused decoder driver's layer table
(`specmoe.models.fused_layers`): which `SparseMoEBlock`s the driver runs as the modules do,
the tensors it reads from them, and their C `Moe` record.

The driver computes a MoE block as `SparseMoEBlock.forward` does on bf16 CPU: the router's
gate through the linear kernel, the routing through the router kernel that `TopKRouter`
itself calls (`specmoe.kernels.router`: softmax in fp32, top-k with the lower-id tie rule,
`norm_topk_prob`), the routed experts through the fused MoE kernel that the "fused" backend
calls (`RoutedExperts.forward_fused`), the shared expert through the linear and SiLU-and-mul
kernels and its sigmoid gate as torch.sigmoid rounds it. So it takes a block only where the
modules take exactly those kernels: the "fused" backend on bf16 experts whose intermediate
size is a multiple of 16 (not `QuantizedRoutedExperts`: `--quantization` makes the modules
run), a router the router kernel takes, bf16 `Linear` gates and a
`GatedMLP` shared expert, and no expert-stats recorder (`NullExpertStats`: the driver hands
no routing back to Python, so a recorder makes the block run as modules, which record).
"""

from __future__ import annotations

import torch

from specmoe.kernels import decoder, moe, router
from specmoe.layers.linear import Linear
from specmoe.layers.mlp import GatedMLP
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.layers.moe.router import TopKRouter
from specmoe.layers.moe.stats import NullExpertStats

BF16 = torch.bfloat16
PER_MOE = 10  # sources per MoE block: 4 x (weights, bias) with the experts' 2 packed copies


def plain_moe(block) -> bool:
    """A `SparseMoEBlock` the driver computes as its modules do (see the module docstring);
    shapes and dtypes are checked by `moe_sources`."""
    if not (type(block) is SparseMoEBlock and type(block.router) is TopKRouter
            and block.router.is_softmax_topk
            and type(block.experts) is RoutedExperts
            and type(block.stats) is NullExpertStats):
        return False
    run = block.run_experts
    if getattr(run, "__func__", None) is not RoutedExperts.forward_fused or \
            getattr(run, "__self__", None) is not block.experts or not block.experts.reads_packed:
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
    w = m.weight
    if type(m) is Linear and w.dtype is BF16 and (w.is_cpu or w.is_meta) \
            and tuple(w.shape) == shape:
        return m.weight_panels.get(w), m.bias
    return None


def moe_sources(block, hidden: int) -> list | None:
    """The block's tensors as the driver reads them: (weights, bias) of the router gate,
    the experts' packed w13 and w2, (weights, bias) of the shared expert's gate/up and down
    projections and of its gate (None, None where absent); None when the driver does not
    run the block (see the module docstring; also the kernels unavailable)."""
    experts, rt = block.experts, block.router
    n, i, k = experts.num_experts, experts.intermediate_size, rt.top_k
    w13, w2 = experts.w13, experts.w2
    if not (w13.dtype is BF16 is w2.dtype and (w13.is_cpu or w13.is_meta)
            and (w2.is_cpu or w2.is_meta) and i % 16 == 0 and i > 0
            and tuple(w13.shape) == (n, 2 * i, hidden) and tuple(w2.shape) == (n, hidden, i)
            and router.applies_to(n, k) and decoder.moe_available()):
        return None
    gate = _linear(rt.gate, (n, hidden))
    if gate is None:
        return None
    try:
        packed = [moe._packed(experts.w13_panels, w13, "w13"),
                  moe._packed(experts.w2_panels, w2, "w2")]
    except (ValueError, RuntimeError):
        return None
    out = [*gate, *packed]
    if block.shared_expert is None:
        return out + [None] * 6
    s = block.shared_expert
    si = s.down_proj.weight.shape[-1]
    parts = [_linear(s.gate_up_proj, (2 * si, hidden)), _linear(s.down_proj, (hidden, si))]
    if block.shared_expert_gate is not None:
        parts.append(_linear(block.shared_expert_gate, (1, hidden)))
    if si % 16 or si == 0 or any(p is None for p in parts):
        return None
    out += [t for p in parts for t in p]
    return out + [None] * (PER_MOE - len(out))


def bias_sizes(block, hidden: int) -> tuple[int, ...]:
    """The sizes of the biases among `moe_sources` (router gate, shared gate/up, shared
    down, shared gate)."""
    si = block.shared_expert.down_proj.weight.shape[-1] if block.shared_expert else 0
    return block.experts.num_experts, 2 * si, hidden, 1


def weights_released(block) -> bool:
    """Whether every dense weight the driver reads packed was released to the meta device
    (then in-place edits cannot change them behind the table's back)."""
    lins = [m for m in moe_modules(block) if type(m) is Linear]
    return block.experts.w13.is_meta and block.experts.w2.is_meta and all(
        m.weight.is_meta for m in lins)


def _lin(weights, bias) -> decoder.Lin:
    if weights is None:
        return decoder.Lin(None, None, 0)
    return decoder.Lin(weights.data_ptr(), None if bias is None else bias.data_ptr(), 0)


def build_moe(block, sources: list) -> decoder.Moe:
    """The C record of a block from its `moe_sources`."""
    experts = block.experts
    s = block.shared_expert
    return decoder.Moe(
        _lin(*sources[0:2]), sources[2].data_ptr(), sources[3].data_ptr(),
        experts.num_experts, block.router.top_k, experts.intermediate_size,
        int(bool(block.router.norm_topk_prob)), _lin(*sources[4:6]), _lin(*sources[6:8]),
        _lin(*sources[8:10]), 0 if s is None else s.down_proj.weight.shape[-1])
