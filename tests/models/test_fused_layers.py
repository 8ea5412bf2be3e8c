"""The fused decoder path (`specmoe.models.fused_layers`, one native call for all layers)
gives the module path's bits: hidden states and every KV cache entry, over prefills,
decodes and multi-token verifications of several sequences, with and without QKV bias,
tied heads and sliding windows; it notices replaced caches and changed weights, and stands
aside (the modules run) for what it does not cover."""

from __future__ import annotations

import contextlib
import gc
import copy
import weakref

import pytest
from kernel_checks import assert_same_runs, fused_driver, require_kernel, run_schedule
import torch

from specmoe import kernels
from specmoe.config import ArchConfig, MoEConfig
from specmoe.kernels import decoder, gemv_int4
from specmoe.layers.linear import prepack_weights
from specmoe.layers.paged_attention import AttentionMetadata, SequenceSlice
from specmoe.layers.quantization import quantize_model
from specmoe.loader.model_loader import default_dtype
from specmoe.models import fused_layers
from specmoe.models.decoder import DecoderModel
from specmoe.worker.kv_cache import PagedKVCache
from tiny_models import randomize_

KERNEL_UNAVAILABLE_REASON = decoder._lazy.unavailable_reason  # for `enabled`
BLOCK = 16
BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _arch(**over) -> ArchConfig:
    fields = dict(architecture="Qwen2ForCausalLM", vocab_size=300, hidden_size=128,
                  intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=512, attention_bias=True)
    fields.update(over)
    return ArchConfig(**fields)


ARCHS = {
    "qwen2_bias": _arch(),
    "llama_tied_mha": _arch(architecture="LlamaForCausalLM", attention_bias=False,
                            tie_word_embeddings=True, num_key_value_heads=3, head_dim=64,
                            hidden_size=192, num_attention_heads=3),
    "mistral_window": _arch(architecture="MistralForCausalLM", attention_bias=False,
                            sliding_window=12),
}


def _model(arch: ArchConfig, dtype=BF16, release: bool = True, seed: int = 0,
           quantization: str | None = None) -> DecoderModel:
    """A random model, quantised and then its dense weights released as the loader does."""
    with default_dtype(dtype):
        model = randomize_(DecoderModel(arch, 256), seed)
    if quantization is not None:
        quantize_model(model, quantization)
    if release:
        prepack_weights(model, release_dense=True)
    return model


# (start_pos, new tokens) per sequence per forward: two prefills (one chunked), then decodes
# and verifications of several rows side by side
SCHEDULE = [[(0, 40), (0, 7)], [(40, 1), (7, 5)], [(41, 4), (12, 1), (0, 19)],
            [(45, 1), (13, 1), (19, 1)]]


# a draft model's forwards: at most 16 rows (int4 projections are fused up to there)
DRAFT_SCHEDULE = [[(0, 9), (0, 7)], [(9, 1), (7, 1)], [(10, 1), (8, 1), (0, 14)],
                  [(11, 1), (9, 1), (14, 1)]]


def _run(model: DecoderModel, arch: ArchConfig, fused: bool, cache: PagedKVCache | None = None,
         schedule=SCHEDULE):
    """Hidden states of every forward of `schedule` and the caches, fused path on or off."""
    return run_schedule(model, arch, fused, schedule, [[0, 1, 2, 3], [5, 4], [9, 7]], cache)


@contextlib.contextmanager
def _counting(monkeypatch):
    calls = []
    real = decoder.run_layers
    monkeypatch.setattr(decoder, "run_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    yield calls


def _assert_same(a, b) -> None:
    assert_same_runs(a, b, BF16)


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("release", [True, False])
def test_fused_layers_give_the_module_bits(enabled, monkeypatch, name, release):
    arch = ARCHS[name]
    model = _model(arch, release=release)
    with _counting(monkeypatch) as calls:
        fused = _run(model, arch, True)
    assert len(calls) == len(SCHEDULE)  # every forward took the fused path
    _assert_same(fused, _run(model, arch, False))


def test_int4_projections_give_the_module_bits_up_to_16_rows(enabled, monkeypatch):
    if not decoder.int4_available():
        require_kernel("int4 kernel for the decoder driver", gemv_int4.kernel_unavailable_reason()
                       or "the decoder driver could not load it")
    arch = ARCHS["qwen2_bias"]
    model = _model(arch, quantization="int4")
    with _counting(monkeypatch) as calls:
        fused = _run(model, arch, True, schedule=DRAFT_SCHEDULE)
    assert len(calls) == len(DRAFT_SCHEDULE)
    _assert_same(fused, _run(model, arch, False, schedule=DRAFT_SCHEDULE))
    with _counting(monkeypatch) as calls:  # forwards of more rows run the modules
        _run(model, arch, True)
    assert len(calls) == sum(sum(n for _, n in step) <= 16 for step in SCHEDULE) == 2


def test_replaced_cache_and_changed_weights_are_followed(enabled, monkeypatch):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch, release=False)
    _run(model, arch, True)
    with torch.no_grad():  # dense weights changed in place: the packed copies follow
        model.layers[1].mlp.down_proj.weight.mul_(-1.5)
        model.layers[0].attn.qkv_proj.bias.add_(0.25)
    with _counting(monkeypatch) as calls:
        fused = _run(model, arch, True)  # a new cache too
    assert len(calls) == len(SCHEDULE)
    _assert_same(fused, _run(model, arch, False))


def test_a_replaced_released_weight_is_followed(enabled):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    before = _run(model, arch, True)
    donor = _model(arch, seed=5)  # new packed copies swapped in for layer 2's MLP
    model.layers[2].mlp = donor.layers[2].mlp
    after = _run(model, arch, True, cache=before[1])
    assert not torch.equal(before[0][-1], after[0][-1])
    _assert_same(after, _run(model, arch, False))


def _moe_arch() -> ArchConfig:
    moe = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=64,
                    norm_topk_prob=True, moe_layers=[1])
    return _arch(moe=moe)


@pytest.mark.parametrize("case", ["moe", "float32", "int8", "grad", "off"])
def test_the_modules_run_where_the_fused_path_does_not_apply(enabled, monkeypatch, case):
    arch = _moe_arch() if case == "moe" else ARCHS["qwen2_bias"]
    model = _model(arch, dtype=torch.float32 if case == "float32" else BF16,
                   quantization="int8" if case == "int8" else None)
    cache = PagedKVCache(arch, 4, BLOCK, model.embed_tokens.weight.dtype, torch.device("cpu"))
    meta = AttentionMetadata.build([SequenceSlice(0, 3, [0])], BLOCK, "cpu")
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    with fused_driver(case != "off"), _counting(monkeypatch) as calls, \
            torch.set_grad_enabled(case == "grad"):
        out = model(ids, pos, cache.layers, meta)
    assert calls == [] and out.shape == (3, arch.hidden_size)


def test_the_modules_run_with_the_cpu_kernels_off(monkeypatch):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    was = kernels.is_enabled()
    kernels.set_enabled(False)
    try:
        with _counting(monkeypatch) as calls:
            outs, _ = _run(model, arch, True)
    finally:
        kernels.set_enabled(was)
    assert calls == [] and len(outs) == len(SCHEDULE)


def test_a_position_past_the_rope_table_raises_as_the_modules_do(enabled):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    cache = PagedKVCache(arch, 20, BLOCK, BF16, torch.device("cpu"))
    meta = AttentionMetadata.build([SequenceSlice(256, 1, list(range(17)))], BLOCK, "cpu")
    with torch.inference_mode(), pytest.raises(IndexError):
        model(torch.tensor([1]), torch.tensor([256]), cache.layers, meta)


def test_a_refused_kernel_names_its_layer_and_step(enabled):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    fused = model.fused_layers
    cache = PagedKVCache(arch, 4, BLOCK, BF16, torch.device("cpu"))
    meta = AttentionMetadata.build([SequenceSlice(0, 2, [0])], BLOCK, "cpu")
    x = torch.zeros(2, arch.hidden_size, dtype=BF16)
    with torch.inference_mode():
        assert fused.try_run(model, x, torch.arange(2), cache.layers, meta) is not None
        dims = decoder.Dims.from_buffer_copy(fused._dims)
        dims.head_dim = 16  # the RoPE kernel takes multiples of 32 only
        with pytest.raises(RuntimeError, match="RoPE kernel of layer 0"):
            decoder.run_layers(dims, fused._table, x, torch.arange(2), meta.slot_mapping,
                               meta.sequences, 0)


def test_a_replaced_layer_and_a_copied_model_are_followed(enabled):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    before = _run(model, arch, True)
    model.layers[1] = _model(arch, seed=7).layers[1]
    after = _run(model, arch, True, cache=before[1])  # the same caches: only the layer moved
    assert not torch.equal(before[0][-1], after[0][-1])
    _assert_same(after, _run(model, arch, False))
    copied = copy.deepcopy(model)  # the table holds addresses: the copy builds its own
    assert copied.fused_layers._table is None
    _assert_same(_run(copied, arch, True), after)


def _swap_qk_norm_layer(model):
    model.layers[1] = _model(_arch(qk_norm="per_head"), seed=3).layers[1]


def _swap_moe_layer(model):
    model.layers[1] = _model(_moe_arch(), seed=4).layers[1]


def _swap_smaller_mlp(model):  # a projection shape the config does not have
    model.layers[1].mlp = _model(_arch(intermediate_size=64), seed=6).layers[1].mlp


def _swap_rope_theta(model):  # another RoPE table in one layer
    model.layers[1] = _model(_arch(rope_theta=1e6), seed=2).layers[1]


def _set_clip(model):  # a plain attribute: the table needs telling
    model.layers[2].attn.clip_qkv = 0.05
    model.fused_layers.invalidate()


def _hook(model):
    model.layers[1].register_forward_hook(lambda mod, args, out: out * 0.5)


@pytest.mark.parametrize("change", [_swap_qk_norm_layer, _swap_moe_layer, _swap_smaller_mlp,
                                    _swap_rope_theta, _set_clip, _hook])
def test_changes_the_driver_does_not_cover_send_forwards_to_the_modules(enabled, monkeypatch,
                                                                        change):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    outs, cache = _run(model, arch, True)
    change(model)
    with _counting(monkeypatch) as calls:
        after = _run(model, arch, True, cache=cache)  # the same caches: no rebuild forced
    assert calls == []
    _assert_same(after, _run(model, arch, False))


@pytest.mark.parametrize("target", ["norm", "bias", "cos", "k_cache"])
def test_storage_swapped_under_a_tensor_is_followed_after_invalidate(enabled, target):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    outs, cache = _run(model, arch, True)
    layer = model.layers[1]
    t = {"norm": layer.post_attn_norm.weight, "bias": layer.attn.qkv_proj.bias,
         "cos": layer.attn.rotary.cos, "k_cache": cache.layers[1][0]}[target]
    with torch.no_grad():
        t.data = t.data.clone() * (1 if target == "k_cache" else 0.5)
    model.fused_layers.invalidate()  # `.data` swaps are not seen otherwise
    _assert_same(_run(model, arch, True, cache=cache), _run(model, arch, False))


def test_a_slot_outside_the_cache_raises_as_the_modules_do(enabled):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    cache = PagedKVCache(arch, 4, BLOCK, BF16, torch.device("cpu"))
    _run(model, arch, True, cache=PagedKVCache(arch, 12, BLOCK, BF16, torch.device("cpu")))
    meta = AttentionMetadata.build([SequenceSlice(0, 3, [10])], BLOCK, "cpu")  # block 10 of 4
    with torch.inference_mode(), pytest.raises(IndexError):
        model(torch.tensor([1, 2, 3]), torch.arange(3), cache.layers, meta)


def test_a_dropped_model_is_freed_without_the_garbage_collector(enabled):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    _run(model, arch, True)
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_fewer_layers_and_caches_are_followed(enabled):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    _run(model, arch, True)
    del model.layers[2]
    fewer = _arch(num_hidden_layers=2)
    _assert_same(_run(model, fewer, True), _run(model, fewer, False))


def test_the_table_is_built_once_for_a_loaded_model(enabled, monkeypatch):
    arch = ARCHS["qwen2_bias"]
    model = _model(arch)
    builds = []
    real = fused_layers.FusedLayers._rebuild
    monkeypatch.setattr(fused_layers.FusedLayers, "_rebuild",
                        lambda self, *a: builds.append(1) or real(self, *a))
    outs, cache = _run(model, arch, True)
    _run(model, arch, True, cache=cache)
    assert len(builds) == 1  # checked per forward in O(1) after that
    torch.nn.Linear(2, 2)  # any module or parameter assignment anywhere: rebuilt once
    _run(model, arch, True, cache=cache)
    assert len(builds) == 2
