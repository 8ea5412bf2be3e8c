"""Loading a GGUF file's blocks into the model at their own type (`quantization="gguf"`).

While the weights load, `BlockStash.take` keeps each `GGUFTensor` meant for a projection
(`Linear`), the token embedding or a MoE block's routed experts instead of copying it into
the module's parameter (which stays untouched, so never resident); when the model loader
finishes a unit (a decoder layer, the embedding, the head), `adopt` swaps each module that
received blocks for its GGUF layer (`specmoe.layers.gguf_layers`). Shards the file stores
unquantised or at a type without a kernel were copied as usual and become dense parts; routed
experts whose projections are not all kept get the kept ones dequantised into their dense
weights instead (one layer never mixes the two forms).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specmoe.kernels.gguf_gemm import GGUFWeight
from specmoe.layers.embed_head import TiedProjection, VocabEmbedding
from specmoe.layers.gguf_layers import GGUFEmbedding, GGUFLinear, GGUFRoutedExperts
from specmoe.layers.linear import Linear
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.loader.gguf_file import GGUFTensor
from specmoe.loader.weights import copy_slot

logger = logging.getLogger(__name__)
_HOSTS = (Linear, VocabEmbedding, RoutedExperts)


class NoBlocks:
    """The stash of a load that keeps no blocks: takes nothing, swaps nothing."""

    def take(self, slot: tuple, tensor: GGUFTensor) -> bool:
        return False

    def adopt(self, unit: nn.Module) -> None:
        pass


class BlockStash(NoBlocks):
    """GGUF blocks taken for `model`'s modules while loading, swapped in unit by unit.

    Args:
        model: the model being loaded (its parameters still untouched).
        dtype: the model's dtype (embeddings are returned in it).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self.taken: dict[nn.Module, dict[tuple, GGUFTensor]] = {}
        self.embeddings: dict[int, GGUFEmbedding] = {}  # id(old embedding) -> its GGUF layer
        self.names = {id(m): name for name, m in model.named_modules()}

    def take(self, slot: tuple, tensor: GGUFTensor) -> bool:
        """Keep `tensor` for slot (parameter name, expert, shard) if its module is a
        projection, embedding or experts weight; False (copy it densely) otherwise."""
        name, expert, shard = slot
        owner, _, attr = name.rpartition(".")
        module = self.model.get_submodule(owner)
        if not isinstance(module, _HOSTS) or attr == "bias":
            return False
        self.taken.setdefault(module, {})[(attr, expert, shard)] = tensor
        return True

    def adopt(self, unit: nn.Module) -> None:
        """Swap every module of `unit` that took blocks (and a head tied to a swapped
        embedding) for its GGUF layer."""
        prefix = self.names[id(unit)]
        for name, module in list(unit.named_modules(prefix=prefix)):
            new = self._replacement(module)
            if new is None:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            if isinstance(parent, SparseMoEBlock) and child == "experts":
                backend = getattr(getattr(parent.run_experts, "__func__", None), "__name__",
                                  "forward")
                parent.run_experts = None
                setattr(parent, child, new)
                parent.run_experts = getattr(new, backend, new.forward)
            else:
                setattr(parent, child, new)

    def _replacement(self, module: nn.Module) -> nn.Module | None:
        if isinstance(module, TiedProjection):
            tied = self.embeddings.get(id(module._embedding[0]))
            return None if tied is None else GGUFLinear(None, None, weight_source=tied.weight_parts)
        taken = self.taken.pop(module, None)
        if taken is None:
            return None
        if isinstance(module, VocabEmbedding):
            new = GGUFEmbedding(taken[("weight", None, None)].weight, self.dtype)
            self.embeddings[id(module)] = new
            return new
        if isinstance(module, Linear):
            return _linear(module, taken)
        return _experts(module, taken)


def _linear(module: Linear, taken: dict[tuple, GGUFTensor]) -> GGUFLinear:
    """A GGUFLinear of the taken shards and the dense rows of the others."""
    sizes = getattr(module.weight, "shard_sizes", [module.weight.shape[0]])
    parts, start = [], 0
    for i, n in enumerate(sizes):
        got = taken.get(("weight", None, i if len(sizes) > 1 else None))
        parts.append(got.weight if got is not None
                     else module.weight.data[start:start + n].clone())
        start += n
    bias = None if module.bias is None else module.bias.data.clone()
    return GGUFLinear(parts, bias)


def _experts(module: RoutedExperts, taken: dict[tuple, GGUFTensor]) -> nn.Module | None:
    """GGUFRoutedExperts when gate, up and down of every expert were taken; else None,
    with the taken ones dequantised into the dense weights."""
    slots = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", None)}
    stacks = {}
    for proj, (attr, shard) in slots.items():
        got = [taken.get((attr, e, shard)) for e in range(module.num_experts)]
        if any(t is None for t in got) or len({int(t.weight.ggml_type) for t in got}) != 1:
            break
        stacks[proj] = _stack(got)
    if len(stacks) == len(slots):
        return GGUFRoutedExperts(stacks["gate"], stacks["up"], stacks["down"])
    logger.info("routed experts with projections at types without a kernel: %s kept "
                "dequantised", type(module).__name__)
    for (attr, expert, shard), tensor in taken.items():
        param = getattr(module, attr)
        copy_slot(param, (attr, expert, shard), tensor.dense(param.dtype), attr)
    return None


def _stack(tensors: list[GGUFTensor]) -> GGUFWeight:
    """One stacked weight [N, out, row_bytes]: the file's stack when the tensors are its
    experts in order, else a copy."""
    first = tensors[0]
    if first.stack is not None and all(t.stack is first.stack and t.expert == e
                                       for e, t in enumerate(tensors)):
        return first.stack
    w = first.weight
    return GGUFWeight(w.ggml_type, torch.stack([t.weight.blocks for t in tensors]),
                      w.in_features)
