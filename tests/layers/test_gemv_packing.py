"""The bf16 kernel's panel layout: the C packer against the plain-torch one, the layers'
packed copies (made once, remade after an edit, moved into huge pages with the weights)."""

from __future__ import annotations

import pytest
import torch

from specmoe import kernels
from specmoe.kernels import gemv
from specmoe.layers.embed_head import TiedProjection, VocabEmbedding
from specmoe.layers.linear import Linear, prepack_weights
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.utils import hugepages

KERNEL_UNAVAILABLE_REASON = kernels.kernel_unavailable_reason  # for the `enabled` fixture


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (64, 2), (65, 33), (130, 576), (2, 5, 9)])
def test_c_packer_matches_reference_and_unpacks(enabled, shape):
    w = torch.randn(shape).bfloat16()
    packed = gemv.pack_weight(w)
    ref = gemv.pack_weight_reference(w)
    assert packed.shape == ref.shape == (*shape[:-2], *gemv.packed_shape(*shape[-2:]))
    assert torch.equal(packed, ref)
    assert torch.equal(gemv.unpack_weight(packed, *shape[-2:]), w)
    out = torch.full_like(ref, float("nan"))
    assert gemv.pack_weight(w, out) is out and torch.equal(out, ref)


def test_pack_rejects_bad_out_and_shapes(enabled):
    w = torch.randn(10, 6).bfloat16()
    with pytest.raises(ValueError, match=r"out must be \(1, 3, 64, 2\)"):
        gemv.pack_weight(w, torch.empty(1, 3, 64, 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[\.\.\., out, in\]"):
        gemv.pack_weight(torch.randn(6).bfloat16())


def test_explicit_packed_weight_is_checked(enabled):
    x, w = torch.randn(3, 40).bfloat16(), torch.randn(70, 40).bfloat16()
    y = kernels.try_linear_bf16(x, w, None, gemv.pack_weight(w))
    assert torch.equal(y, kernels.try_linear_bf16(x, w))
    with pytest.raises(ValueError, match=r"packed weight must be \(2, 20, 64, 2\)"):
        kernels.try_linear_bf16(x, w, None, gemv.pack_weight(w[:64]))


def test_packed_weight_cache_repacks_after_edits(enabled):
    layer = Linear(40, 70).bfloat16().requires_grad_(False)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(2, 40).bfloat16()
    first = layer(x)
    packed = layer.weight_panels.packed
    assert packed is not None and layer(x) is not None and layer.weight_panels.packed is packed
    layer.weight.mul_(2)  # in place through the parameter: seen
    assert torch.equal(layer(x), kernels.try_linear_bf16(x, layer.weight))
    assert not torch.equal(layer(x), first)
    layer.weight.data = torch.randn(70, 40).bfloat16()  # new storage: seen
    assert torch.equal(layer(x), kernels.try_linear_bf16(x, layer.weight))


def test_prepack_and_huge_pages_move_the_packed_copies(enabled, monkeypatch):
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)
    torch.manual_seed(0)
    emb = VocabEmbedding(300, 64).bfloat16()
    model = torch.nn.ModuleList([Linear(64, 200).bfloat16(), TiedProjection(emb), emb,
                                 RoutedExperts(3, 64, 96).bfloat16()])
    for p in model.parameters():
        torch.nn.init.normal_(p)
    model.requires_grad_(False)
    x = torch.randn(4, 64).bfloat16()
    before = [model[0](x), model[1](x), model[3].expert_forward(2, x)]
    for sub in (model[0], model[1], model[3]):
        for cache, _ in sub.packed_weights():
            cache.clear()
    packed_bytes = prepack_weights(model)
    assert packed_bytes == sum(t.nbytes for m in (model[0], model[1], model[3])
                               for t in m.extra_weights()) > 0
    moved = hugepages.rehome_module(model)
    if hugepages.in_huge_pages([((1,), torch.uint8)]):
        assert moved >= packed_bytes
    caches = [c for m in (model[0], model[1], model[3]) for c, _ in m.packed_weights()]
    kept = [c.packed for c in caches]
    after = [model[0](x), model[1](x), model[3].expert_forward(2, x)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(c.packed is k for c, k in zip(caches, kept)), "rehomed copies were repacked"


def test_no_packing_where_the_kernel_does_not_apply(enabled):
    layer = Linear(40, 70).requires_grad_(False)  # float32
    torch.nn.init.normal_(layer.weight)
    layer(torch.randn(2, 40))
    layer.prepack()
    assert layer.weight_panels.packed is None and layer.extra_weights() == []


def _model_with_every_packed_kind():
    torch.manual_seed(0)
    emb = VocabEmbedding(300, 64).bfloat16()
    model = torch.nn.ModuleList([Linear(64, 200, bias=True).bfloat16(), TiedProjection(emb),
                                 emb, RoutedExperts(3, 64, 96).bfloat16()])
    for p in model.parameters():
        torch.nn.init.normal_(p)
    return model.requires_grad_(False)


def _outputs(model, x):
    return [model[0](x), model[0].forward_reference(x), model[1](x),
            model[3].expert_forward(2, x)]


def test_released_dense_weights_keep_every_path(enabled):
    """After `release_dense`, the owned weights live only in their packed copies: the
    kernel, the plain-torch reference and the kernels-off path give what they gave before,
    and the tied head keeps the embedding's table."""
    model = _model_with_every_packed_kind()
    x = torch.randn(5, 64).bfloat16()
    before = _outputs(model, x)
    kernels.set_enabled(False)
    before_off = _outputs(model, x)
    kernels.set_enabled(True)
    dense = model[0].weight.nbytes + model[3].w13.nbytes + model[3].w2.nbytes
    prepack_weights(model)
    assert sum(m.release_dense() for m in (model[0], model[1], model[3])) == dense
    assert model[0].weight.is_meta and model[3].w13.is_meta and model[3].w2.is_meta
    assert model[2].weight.is_cpu and model[1].weight.is_cpu
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model, x), before))
    kernels.set_enabled(False)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model, x), before_off))
    assert model[0].release_dense() == 0  # once


def test_release_without_a_packed_copy_keeps_the_weight(enabled):
    layer = Linear(64, 70).bfloat16().requires_grad_(False)
    torch.nn.init.normal_(layer.weight)
    assert layer.release_dense() == 0 and layer.weight.is_cpu
    layer.prepack()
    layer.weight.data = layer.weight.data.clone()  # the copy is stale now
    assert layer.release_dense() == 0 and layer.weight.is_cpu


def test_a_new_weight_at_a_freed_ones_address_is_repacked(enabled):
    """A replacement weight may reuse the freed one's address and version count: the cache
    compares the tensor itself too (with the address and version alone this loop met a
    stale copy in 1-10 of 50 rounds)."""
    layer = Linear(64, 64).bfloat16().requires_grad_(False)
    x = torch.randn(2, 64).bfloat16()

    def fresh():  # bf16 storage, version 1: the freed one's address may come back
        return torch.nn.Parameter(torch.empty(64, 64, dtype=torch.bfloat16).normal_(),
                                  requires_grad=False)

    for _ in range(200):
        layer.weight = fresh()
        layer(x)
        layer.weight = None
        layer.weight = fresh()
        assert torch.equal(layer(x), kernels.try_linear_bf16(x, layer.weight))


def test_released_weights_follow_a_dtype_change(enabled):
    """`model.float()` after a release turns the meta parameters fp32: the unpacked values
    follow (the bf16 values, as fp32)."""
    layer = Linear(64, 70).bfloat16().requires_grad_(False)
    torch.nn.init.normal_(layer.weight)
    dense = layer.weight.detach().clone()
    layer.prepack()
    layer.release_dense()
    layer.float()
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ dense.float().t())
