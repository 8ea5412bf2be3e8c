"""Applying a family's declarative mapping table to checkpoint tensors.

Every parameter element must be written exactly once: a checkpoint tensor no rule maps, a
parameter slice no tensor fills, or a shape mismatch raises ValueError naming it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from specmoe.loader.gguf_file import GGUFTensor
from specmoe.models.weight_rules import IGNORED, WeightRule

_MAX_LISTED = 8


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                 rules: list[WeightRule], tied_embeddings: bool,
                 on_param_loaded: Callable[[str], None] = lambda name: None,
                 take_blocks: Callable[[tuple, GGUFTensor], bool] = lambda slot, t: False
                 ) -> None:
    """Copy checkpoint `tensors` (HuggingFace names) into `model`'s parameters, calling
    `on_param_loaded(name)` as each parameter gets the last of its slots (its experts and
    shards), before the next tensor is read. A `GGUFTensor` (blocks kept at the file's
    type) fills its slot through `take_blocks(slot, tensor)` where that returns True (the
    slot is then loaded, its parameter untouched), else it is dequantised and copied. A
    slot is (parameter name, expert or None, shard or None).

    Raises:
        ValueError: unexpected checkpoint tensors, missing parameters, a parameter filled
            twice, or shape mismatches.
    """
    params = dict(model.named_parameters())
    expected = set(_expected_slots(params))
    slots_left = Counter(slot[0] for slot in expected)
    loaded: set[tuple] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if any(p.match(name) for p in IGNORED):
            continue
        if tied_embeddings and name == "lm_head.weight":
            continue  # tied to embed_tokens; some checkpoints still store a copy
        slot = _match(name, rules)
        if slot in loaded:
            raise ValueError(f"checkpoint tensor {name} fills {_fmt(slot)} a second time")
        if slot is None or slot[0] not in params:
            unexpected.append(name)
            continue
        if isinstance(tensor, GGUFTensor) and not take_blocks(slot, tensor):
            tensor = tensor.dense(params[slot[0]].dtype)
        if not isinstance(tensor, GGUFTensor):
            copy_slot(params[slot[0]], slot, tensor, name)
        loaded.add(slot)
        slots_left[slot[0]] -= 1
        if not slots_left[slot[0]]:
            # no reference kept: the callback may quantise or pack it and drop the dense copy
            del params[slot[0]]
            on_param_loaded(slot[0])
    _raise_if(unexpected, "unexpected checkpoint tensors (no parameter takes them)")
    _raise_if(sorted(_fmt(s) for s in expected - loaded), "missing weights")


def _match(name: str, rules: list[WeightRule]) -> tuple | None:
    for r in rules:
        m = r.pattern.match(name)
        if m:
            groups = m.groupdict()
            expert = int(groups["e"]) if groups.get("e") is not None else None
            return (r.target.format(**groups), expert, r.shard)
    return None


def _expected_slots(params: dict[str, nn.Parameter]) -> Iterator[tuple]:
    for name, p in params.items():
        experts = range(p.num_experts) if hasattr(p, "num_experts") else [None]
        shards = range(len(p.shard_sizes)) if hasattr(p, "shard_sizes") else [None]
        for e in experts:
            for s in shards:
                yield (name, e, s)


def copy_slot(param: nn.Parameter, slot: tuple, tensor: torch.Tensor, ckpt_name: str) -> None:
    _, expert, shard = slot
    view = param.data if expert is None else param.data[expert]
    if shard is not None:
        offset = sum(param.shard_sizes[:shard])
        view = view.narrow(0, offset, param.shard_sizes[shard])
    expected = tuple(view.shape)
    if expected != tuple(tensor.shape):
        view = _padded_view(param, view, tensor.shape)
    if view is None:
        raise ValueError(f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, "
                         f"expected {expected} for {_fmt(slot)}")
    view.copy_(tensor)


def _padded_view(param: nn.Parameter, view: torch.Tensor, shape: torch.Size
                 ) -> torch.Tensor | None:
    """For a parameter stored zero-padded (`pad_multiple`: each dimension the checkpoint's
    size rounded up to it), zero `view` and return its leading part of `shape`; None when
    the parameter is not padded or `shape` does not round up to the view's."""
    m = getattr(param, "pad_multiple", None)
    if m is None or len(shape) != view.dim() or any(
            s != v and -(-s // m) * m != v for s, v in zip(shape, view.shape)):
        return None
    view.zero_()
    for dim, size in enumerate(shape):
        view = view.narrow(dim, 0, size)
    return view


def _fmt(slot: tuple) -> str:
    name, expert, shard = slot
    return name + (f"[expert {expert}]" if expert is not None else "") + (
        f"[shard {shard}]" if shard is not None else "")


def _raise_if(items: list[str], what: str) -> None:
    if items:
        more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
        raise ValueError(f"{what}: {', '.join(items[:_MAX_LISTED])}{more}")
