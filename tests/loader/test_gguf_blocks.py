"""Loading a GGUF file's blocks at their own type (`quantization="gguf"`): which modules take
them, the same model as the dequantised load up to float32 summation order, greedy
speculation equal to plain decoding, and clear errors where the mode cannot apply."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from test_gguf_quant_types import _dense_shapes, _moe_shapes, random_raw, write_model

from specmoe import LLM, kernels
from specmoe.config import ModelConfig
from specmoe.kernels import gguf_gemm
from specmoe.layers.gguf_layers import GGUFEmbedding, GGUFLinear, GGUFRoutedExperts
from specmoe.loader.model_loader import load_model
from specmoe.sampling_params import SamplingParams
from tests.gguf_blocks import random_blocks

# a Q4_K_M-like mix: most matrices Q4_K, some Q6_K / Q5_0 / Q8_0, one shard left F32
_DENSE_TYPES = {
    "token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K,
    "blk.0.attn_q.weight": QT.Q4_K, "blk.0.attn_k.weight": QT.Q5_0,
    "blk.0.attn_v.weight": QT.F32, "blk.0.attn_output.weight": QT.Q8_0,
    "blk.0.ffn_gate.weight": QT.Q4_K, "blk.0.ffn_up.weight": QT.Q5_K,
    "blk.0.ffn_down.weight": QT.Q6_K,
}
_MOE_TYPES = {
    "token_embd.weight": QT.Q4_0, "output.weight": QT.Q8_0,
    "blk.0.attn_q.weight": QT.Q4_1, "blk.0.attn_k.weight": QT.Q5_1,
    "blk.0.attn_v.weight": QT.Q6_K, "blk.0.attn_output.weight": QT.Q4_K,
    "blk.0.ffn_gate_exps.weight": QT.Q4_K, "blk.0.ffn_up_exps.weight": QT.Q4_K,
    "blk.0.ffn_down_exps.weight": QT.Q6_K, "blk.0.ffn_gate_shexp.weight": QT.Q8_0,
    "blk.0.ffn_up_shexp.weight": QT.Q5_0, "blk.0.ffn_down_shexp.weight": QT.Q4_0,
}


@contextlib.contextmanager
def kernels_switched_off():
    kernels.set_enabled(False)
    try:
        yield
    finally:
        kernels.set_enabled(True)


def _raw(t: QT, shape: tuple[int, ...], rng) -> np.ndarray:
    if t == QT.F32:
        return random_raw(t, shape, rng)
    *lead, k = shape
    return random_blocks(t, int(np.prod(lead)), k, seed=int(rng.integers(1 << 30))).reshape(*lead, -1)


def _write(path, arch, shapes, types):
    rng = np.random.default_rng(0)
    raw = {name: (_raw(t, shapes[name], rng), t) for name, t in types.items()}
    write_model(path, arch, shapes, raw, rng)
    return path


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen2moe"])
def gguf_file(request, tmp_path_factory):
    if gguf_gemm.kernel() is None:
        pytest.skip(f"GGUF block kernel unavailable: {gguf_gemm._lazy.unavailable}")
    moe = request.param == "qwen2moe"
    shapes = _moe_shapes() if moe else _dense_shapes()
    if request.param == "llama":  # no attention biases
        shapes = {name: shape for name, shape in shapes.items() if not name.endswith(".bias")}
    path = tmp_path_factory.mktemp("blocks") / f"{request.param}.gguf"
    return _write(path, request.param, shapes, _MOE_TYPES if moe else _DENSE_TYPES)


def test_the_file_blocks_are_what_the_model_holds(gguf_file):
    model = load_model(ModelConfig(str(gguf_file), quantization="gguf")).model
    assert isinstance(model.embed_tokens, GGUFEmbedding)
    assert isinstance(model.lm_head.proj, GGUFLinear)
    qkv = model.layers[0].attn.qkv_proj
    assert isinstance(qkv, GGUFLinear)
    # the F32 shard (dense) beside blocks, or three block shards
    assert (None in qkv.parts.types) == ("qwen2moe" not in gguf_file.name)  # attn_v F32
    if "qwen2moe" in gguf_file.name:
        experts = model.layers[0].mlp.experts
        assert isinstance(experts, GGUFRoutedExperts)
        assert experts.num_experts == 3 and experts.intermediate_size == 512


def test_same_logits_as_the_plain_torch_reference(gguf_file):
    """The kernels (block products, float32 attention) against the plain-torch references
    of the same arithmetic (activations rounded as the kernel rounds them): the same tokens
    and log-probabilities within float32 summation error; and the first token's
    distribution close to the dequantised float32 model's (the activations' int8 rounding
    is the only difference)."""
    prompt = [[1, 5, 9, 33, 70, 2, 11, 60]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    blocks = LLM(str(gguf_file), quantization="gguf").generate(prompt, params)[0]
    with kernels_switched_off():
        reference = LLM(str(gguf_file), quantization="gguf").generate(prompt, params)[0]
    assert blocks.token_ids == reference.token_ids
    for got, want in zip(blocks.logprobs, reference.logprobs):
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        assert np.allclose([lp for _, lp in got.top_logprobs],
                           [lp for _, lp in want.top_logprobs], atol=1e-3)
    dense = LLM(str(gguf_file)).generate(prompt, params)[0]
    got, want = dict(blocks.logprobs[0].top_logprobs), dict(dense.logprobs[0].top_logprobs)
    assert blocks.token_ids[0] == dense.token_ids[0]
    assert abs(got[blocks.token_ids[0]] - want[dense.token_ids[0]]) < 0.1


def test_greedy_speculation_equals_plain_decoding(gguf_file):
    prompts = [[1, 5, 9, 33, 70, 2], [4, 4, 4, 4, 4, 4, 4, 4], [90, 3]]
    params = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM(str(gguf_file), quantization="gguf")
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft", "draft_model": str(gguf_file), "num_speculative_tokens": 3,
                  "draft_quantization": "gguf"}):
        got = [o.token_ids for o in llm.with_speculative(spec).generate(prompts, params)]
        assert got == plain, spec


def test_gguf_mode_refuses_what_it_cannot_load(tmp_path, gguf_file):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="keeps a .gguf file's blocks"):
        load_model(ModelConfig(str(tmp_path), quantization="gguf"))
    with pytest.raises(ValueError, match="must be None or one of"):
        ModelConfig(str(gguf_file), quantization="q4")
