"""Weights in huge-page regions: same values, shared tensors and views stay shared, int4
kernel copies follow, and everything falls back to torch's allocator where huge pages are
off."""

from __future__ import annotations

import gc
import io

import pytest
from kernel_checks import require_kernel
import torch
from torch import nn

from specmoe.kernels import gemv_int4
from specmoe.layers.quantization import Int4Linear, quantize_int4
from specmoe.utils import hugepages

needs_thp = pytest.mark.skipif(not hugepages.supported(),
                               reason="transparent huge pages unavailable here")


@pytest.fixture
def small_regions(monkeypatch):
    """Regions for any size (the tensors of these tests are small)."""
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)


@needs_thp
def test_zeros_many_lays_tensors_out_back_to_back_on_a_huge_page(small_regions):
    specs = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((2, 2, 2), torch.uint8)]
    tensors = hugepages.zeros_many(specs)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == specs
    assert all(t.is_contiguous() and not t.any() for t in tensors)
    assert tensors[0].data_ptr() % hugepages.HUGE_PAGE == 0
    assert [t.data_ptr() - tensors[0].data_ptr() for t in tensors] == [0, 64, 128]
    tensors[1].fill_(2.5)  # writable, and the neighbours are untouched
    assert tensors[1].sum() == 17.5 and not tensors[0].any() and not tensors[2].any()
    # each has a storage of its own: saving one writes its bytes, not the region's
    assert [t.untyped_storage().nbytes() for t in tensors] == [30, 28, 8]
    saved = io.BytesIO()
    torch.save(tensors[1], saved)
    assert len(saved.getvalue()) < 4096


@needs_thp
def test_tensors_keep_their_mapping_alive(small_regions):
    t = hugepages.zeros_many([((1000,), torch.float32)])[0]
    gc.collect()
    t += 1.0
    assert t.sum() == 1000.0


@pytest.mark.parametrize("content,expected", [("always [madvise] never\n", True),
                                              ("[always] madvise never\n", True),
                                              ("always madvise [never]\n", False),
                                              (None, False)])
def test_supported_follows_the_kernel_setting(monkeypatch, tmp_path, content, expected):
    path = tmp_path / "enabled"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(hugepages, "THP_ENABLED", str(path))
    monkeypatch.delenv(hugepages.DISABLE_ENV, raising=False)
    import mmap
    assert hugepages.supported() is (expected and hasattr(mmap, "MADV_HUGEPAGE"))


def test_zeros_many_falls_back_to_torch_when_disabled(monkeypatch, small_regions):
    monkeypatch.setenv(hugepages.DISABLE_ENV, "1")
    assert not hugepages.supported()
    tensors = hugepages.zeros_many([((4, 4), torch.float32), ((3,), torch.bfloat16)])
    assert all(t.untyped_storage().nbytes() == t.nbytes and not t.any() for t in tensors)


def test_small_totals_stay_with_torch():
    assert not hugepages.in_huge_pages([((4, 4), torch.float32)])  # 64 bytes < MIN_BYTES


@needs_thp
def test_rehome_keeps_values_and_tied_weights_shared(small_regions):
    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": nn.Embedding(64, 32), "proj": nn.Linear(32, 16)})
    model.head = nn.Linear(32, 64, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.register_buffer("table", torch.arange(10.0))
    model.register_buffer("view", torch.arange(20.0)[5:])  # a view of a storage of 20
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = hugepages.rehome_module(model)
    assert moved == sum(t.nbytes for t in (model.embed.weight, model.proj.weight,
                                          model.proj.bias, model.table)) + 20 * 4
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.head.weight is model.embed.weight
    start = min(t.data_ptr() for t in (model.embed.weight, model.proj.weight, model.table))
    assert start % hugepages.HUGE_PAGE == 0
    assert model.view.storage_offset() == 5 and model.view.untyped_storage().nbytes() == 80
    x = torch.randint(0, 64, (5,))
    embed = before["embed.weight"]
    assert torch.equal(model.head(model.embed(x)), embed[x] @ embed.T)


@needs_thp
def test_rehome_keeps_views_and_reinterpretations_of_one_storage_together(small_regions):
    """Every tensor on a storage moves with it, keeping offset, shape, strides and dtype."""
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(16, 16))
    model.register_buffer("flat", model.w.data.view(-1))
    model.register_buffer("bits", model.w.data.view(torch.int32))
    model.register_buffer("row", model.w.data[3])
    model.register_buffer("col", model.w.data[:, 2])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layout = {k: (v.dtype, v.shape, v.stride(), v.storage_offset())
              for k, v in model.state_dict().items()}
    assert hugepages.rehome_module(model) == 16 * 16 * 4
    for k, v in model.state_dict().items():
        assert (v.dtype, v.shape, v.stride(), v.storage_offset()) == layout[k], k
        assert torch.equal(v, before[k]), k
    storage = model.w.untyped_storage().data_ptr()
    assert all(getattr(model, k).untyped_storage().data_ptr() == storage
               for k in ("flat", "bits", "row", "col"))
    model.w.data[3, 2] = 7.0  # still one memory
    assert model.row[2] == 7.0 and model.col[3] == 7.0 and model.flat[50] == 7.0


@needs_thp
def test_rehome_moves_the_int4_kernel_copy_and_keeps_its_output(small_regions):
    torch.manual_seed(0)
    q, sz = quantize_int4(torch.randn(64, 128))
    layer = Int4Linear(q, sz, 32, torch.randn(64))
    if layer.cpu_kernel is None:
        require_kernel("int4 kernel", gemv_int4.kernel_unavailable_reason())
    x = torch.randn(3, 128).bfloat16()
    want = layer(x)
    old = [t.data_ptr() for t in layer.extra_weights()]
    hugepages.rehome_module(layer)
    new = [t.data_ptr() for t in layer.extra_weights()]
    assert not set(old) & set(new)
    assert torch.equal(layer(x), want)


def test_rehome_does_nothing_where_disabled(monkeypatch, small_regions):
    monkeypatch.setenv(hugepages.DISABLE_ENV, "1")
    layer = nn.Linear(8, 8)
    ptr = layer.weight.data_ptr()
    assert hugepages.rehome_module(layer) == 0 and layer.weight.data_ptr() == ptr
