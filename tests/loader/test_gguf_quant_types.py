"""GGUFCheckpoint on the quantisation types real GGUF files use, from raw GGUF blocks.

Qwen2.5-Coder GGUFs (Q4_K_M and friends) hold Q4_K, Q5_0, Q6_K and Q8_0 weights; SmolLM2's
hold F32, F16 and Q4_1. For each type, a tensor is built directly in that type's raw block
format (random bytes for the quantised payload, finite fp16 scale fields), written as one
weight of a tiny `qwen2` (or `qwen2moe`) GGUF file whose other tensors are F32, and read back
with `GGUFCheckpoint.iter_tensors`. The tensor yielded under the HF name must be
`gguf.quants.dequantize(raw, type)` reshaped to HF's [out, in], exactly in float32 and up to
bf16 rounding in bfloat16. Shapes are chosen with out != in so a transposition cannot pass.

The files are written with `gguf.GGUFWriter` directly (not `gguf_writer.write_gguf_from_hf`)
so the raw bytes are exactly what is stored, and no transformers model has to be built.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT

from specmoe.loader.gguf_file import GGUFCheckpoint

# Byte offsets of the fp16 fields in one block of each quantised type (ggml-common.h):
#   Q4_1  {d, m, qs[16]}                          Q5_0 {d, qh[4], qs[16]}
#   Q8_0  {d, qs[32]}                             Q4_K {d, dmin, scales[12], qs[128]}
#   Q6_K  {ql[128], qh[64], scales[16] (int8), d}
# Everything else in a block is integer data, so random bytes there give finite values.
_FP16_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q8_0: (0,),
    QT.Q4_K: (0, 2),
    QT.Q6_K: (208,),
}
_QUANTIZED = list(_FP16_FIELDS)
_ALL_TYPES = [QT.F32, QT.F16, *_QUANTIZED]

# Tiny qwen2: hidden 256 and intermediate 512, so every row length is a multiple of the K-quant
# super-block (256) and every matrix has out != in.
VOCAB, HIDDEN, INTER, HEADS, KV_HEADS = 96, 256, 512, 4, 2
HEAD_DIM = HIDDEN // HEADS
KV_DIM = KV_HEADS * HEAD_DIM
NUM_EXPERTS, MOE_INTER, SHARED_INTER = 3, 512, 256


def _dense_shapes() -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy (= HF) shape of a 1-layer qwen2 model."""
    return {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_q.bias": (HIDDEN,),
        "blk.0.attn_k.weight": (KV_DIM, HIDDEN),
        "blk.0.attn_k.bias": (KV_DIM,),
        "blk.0.attn_v.weight": (KV_DIM, HIDDEN),
        "blk.0.attn_v.bias": (KV_DIM,),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.ffn_gate.weight": (INTER, HIDDEN),
        "blk.0.ffn_up.weight": (INTER, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, INTER),
    }


def _moe_shapes() -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape of a 1-layer qwen2moe model (stacked experts)."""
    shapes = {k: v for k, v in _dense_shapes().items() if "ffn_gate." not in k and "ffn_up." not in k}
    del shapes["blk.0.ffn_down.weight"]
    shapes.update({
        "blk.0.ffn_gate_inp.weight": (NUM_EXPERTS, HIDDEN),
        "blk.0.ffn_gate_exps.weight": (NUM_EXPERTS, MOE_INTER, HIDDEN),
        "blk.0.ffn_up_exps.weight": (NUM_EXPERTS, MOE_INTER, HIDDEN),
        "blk.0.ffn_down_exps.weight": (NUM_EXPERTS, HIDDEN, MOE_INTER),
        "blk.0.ffn_gate_shexp.weight": (SHARED_INTER, HIDDEN),
        "blk.0.ffn_up_shexp.weight": (SHARED_INTER, HIDDEN),
        "blk.0.ffn_down_shexp.weight": (HIDDEN, SHARED_INTER),
        "blk.0.ffn_gate_inp_shexp.weight": (HIDDEN,),
    })
    return shapes


# GGUF -> HF checkpoint names of the dense qwen2 tensors (llama.cpp convert_hf_to_gguf naming).
_DENSE_HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_q.bias": "model.layers.0.self_attn.q_proj.bias",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_k.bias": "model.layers.0.self_attn.k_proj.bias",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_v.bias": "model.layers.0.self_attn.v_proj.bias",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
}


def random_raw(qtype: QT, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A tensor of numpy shape `shape` in `qtype`'s storage format, with finite values.

    F32/F16: a float array of `shape`. Quantised types: uint8 [*shape[:-1], bytes per row],
    random bytes with every fp16 scale field set to a small finite value.
    """
    if qtype == QT.F32:
        return rng.standard_normal(shape).astype(np.float32)
    if qtype == QT.F16:
        return rng.standard_normal(shape).astype(np.float16)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    *lead, row = shape
    assert row % block_size == 0, f"row length {row} is not a multiple of {qtype.name}'s block {block_size}"
    blocks = rng.integers(0, 256, size=(*lead, row // block_size, type_size), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype]:
        scale = rng.uniform(-0.05, 0.05, size=(*blocks.shape[:-1], 1)).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8)
    return blocks.reshape(*lead, row // block_size * type_size)


def dequantized(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 array `gguf.quants.dequantize` gives for `raw`, in numpy shape `shape`."""
    return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)


def write_model(
    path: Path, arch: str, shapes: dict[str, tuple[int, ...]], raw: dict[str, tuple[np.ndarray, QT]],
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """Write a 1-layer `arch` GGUF: tensors in `raw` as given, all others random F32.

    Returns the F32 tensors written, by GGUF name.
    """
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if arch == "qwen2moe":
        writer.add_expert_count(NUM_EXPERTS)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(MOE_INTER)
        writer.add_expert_shared_feed_forward_length(SHARED_INTER)
    f32: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        if name in raw:
            data, qtype = raw[name]
            if qtype in (QT.F32, QT.F16):
                writer.add_tensor(name, data)
            else:  # GGUF shape comes from the byte shape and raw_dtype
                writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            f32[name] = rng.standard_normal(shape).astype(np.float32)
            writer.add_tensor(name, f32[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return f32


def _check_stored(path: Path, name: str, qtype: QT, shape: tuple[int, ...]) -> None:
    """The file stores `name` as `qtype` with GGUF dims = reversed numpy shape (test setup)."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    assert tensor.tensor_type == qtype
    assert tensor.shape.tolist() == list(reversed(shape))


def _assert_bf16(actual: torch.Tensor, expected: np.ndarray) -> None:
    expected_t = torch.from_numpy(expected)
    assert actual.dtype == torch.bfloat16
    assert torch.equal(actual, expected_t.to(torch.bfloat16))
    # bf16 keeps 8 significant bits: relative rounding error <= 2**-8 (same exponent range as f32)
    error = (actual.float() - expected_t).abs()
    assert bool((error <= expected_t.abs() * 2.0**-8).all())


# ------------------------------------------------------------------------- layout self-checks


@pytest.mark.parametrize("qtype", _QUANTIZED, ids=lambda t: t.name)
def test_block_layout_matches_gguf(qtype):
    """The fp16 offsets above are the scale fields: zeroing them zeroes every value."""
    cls = getattr(gguf.quants, qtype.name)
    assert (cls.block_size, cls.type_size) == GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = random_raw(qtype, (8, 512), rng)
    values = dequantized(raw, qtype, (8, 512))
    assert np.isfinite(values).all() and np.count_nonzero(values) > 0
    blocks = raw.reshape(8, -1, cls.type_size).copy()
    for offset in _FP16_FIELDS[qtype]:
        blocks[..., offset:offset + 2] = 0
    assert not dequantized(blocks.reshape(8, -1), qtype, (8, 512)).any()


# ------------------------------------------------------------------------- dense qwen2

# (GGUF name, numpy/HF shape [out, in]); all have out != in.
_DENSE_TARGETS = [
    ("blk.0.ffn_down.weight", (HIDDEN, INTER)),  # out < in
    ("blk.0.ffn_up.weight", (INTER, HIDDEN)),  # out > in
    ("blk.0.attn_k.weight", (KV_DIM, HIDDEN)),
    ("token_embd.weight", (VOCAB, HIDDEN)),
    ("output.weight", (VOCAB, HIDDEN)),
]


@pytest.fixture(scope="module")
def dense_file(tmp_path_factory):
    """Memoised (qtype, GGUF name) -> (path, expected float32 [out, in], other F32 tensors)."""
    cache: dict = {}

    def make(qtype: QT, name: str):
        if (qtype, name) not in cache:
            shape = dict(_DENSE_TARGETS)[name]
            rng = np.random.default_rng(zlib.crc32(f"{qtype.name}/{name}".encode()))
            raw = random_raw(qtype, shape, rng)
            path = tmp_path_factory.mktemp("dense") / f"{qtype.name}.gguf"
            f32 = write_model(path, "qwen2", _dense_shapes(), {name: (raw, qtype)}, rng)
            _check_stored(path, name, qtype, shape)
            expected = dequantized(raw, qtype, shape)
            assert np.isfinite(expected).all()
            cache[qtype, name] = path, expected, f32
        return cache[qtype, name]

    return make


@pytest.mark.parametrize("name", [n for n, _ in _DENSE_TARGETS])
@pytest.mark.parametrize("qtype", _ALL_TYPES, ids=lambda t: t.name)
def test_dense_weight_float32_exact(dense_file, qtype, name):
    path, expected, f32 = dense_file(qtype, name)
    checkpoint = GGUFCheckpoint(path)
    tensors = dict(checkpoint.iter_tensors(torch.float32))
    actual = tensors[_DENSE_HF_NAMES[name]]
    assert actual.dtype == torch.float32
    assert tuple(actual.shape) == expected.shape  # HF [out, in], not GGUF [in, out]
    assert torch.equal(actual, torch.from_numpy(expected))
    # Every tensor is there under its HF name, and the F32 neighbours come through unchanged.
    assert sorted(tensors) == sorted(_DENSE_HF_NAMES.values())
    for gguf_name, array in f32.items():
        assert torch.equal(tensors[_DENSE_HF_NAMES[gguf_name]], torch.from_numpy(array)), gguf_name


@pytest.mark.parametrize("name", [n for n, _ in _DENSE_TARGETS])
@pytest.mark.parametrize("qtype", _ALL_TYPES, ids=lambda t: t.name)
def test_dense_weight_bfloat16(dense_file, qtype, name):
    path, expected, _ = dense_file(qtype, name)
    tensors = dict(GGUFCheckpoint(path).iter_tensors(torch.bfloat16))
    actual = tensors[_DENSE_HF_NAMES[name]]
    assert tuple(actual.shape) == expected.shape
    _assert_bf16(actual, expected)


@pytest.mark.parametrize("qtype", _ALL_TYPES, ids=lambda t: t.name)
def test_config_shapes_read_from_quantized_file(dense_file, qtype):
    """hf_config does not depend on the storage type of the weights."""
    path, _, _ = dense_file(qtype, "blk.0.ffn_down.weight")
    config = GGUFCheckpoint(path).hf_config
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (HIDDEN, INTER, VOCAB)
    assert config["tie_word_embeddings"] is False


# ------------------------------------------------------------------------- qwen2moe experts

_EXPERT_TARGETS = {
    "blk.0.ffn_down_exps.weight": ((NUM_EXPERTS, HIDDEN, MOE_INTER), "down_proj"),
    "blk.0.ffn_gate_exps.weight": ((NUM_EXPERTS, MOE_INTER, HIDDEN), "gate_proj"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(_EXPERT_TARGETS))
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_stacked_experts_split_per_expert(tmp_path, qtype, name, dtype):
    """GGUF [in, out, E] (numpy [E, out, in]) -> E HF tensors [out, in], each its own slice."""
    shape, proj = _EXPERT_TARGETS[name]
    rng = np.random.default_rng(7)
    raw = random_raw(qtype, shape, rng)
    path = tmp_path / "moe.gguf"
    write_model(path, "qwen2moe", _moe_shapes(), {name: (raw, qtype)}, rng)
    _check_stored(path, name, qtype, shape)
    expected = dequantized(raw, qtype, shape)
    assert np.isfinite(expected).all()
    # Experts differ, so a mix-up of the expert axis would show.
    assert not np.array_equal(expected[0], expected[1])

    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.hf_config["num_experts"] == NUM_EXPERTS
    tensors = dict(checkpoint.iter_tensors(dtype))
    for expert in range(NUM_EXPERTS):
        actual = tensors[f"model.layers.0.mlp.experts.{expert}.{proj}.weight"]
        assert tuple(actual.shape) == shape[1:]  # [out, in]
        if dtype == torch.float32:
            assert torch.equal(actual, torch.from_numpy(expected[expert]))
        else:
            _assert_bf16(actual, expected[expert])
    assert f"model.layers.0.mlp.experts.{NUM_EXPERTS}.{proj}.weight" not in tensors
