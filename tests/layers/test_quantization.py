"""Weight-only int8/int4 layers: the fused CPU kernels agree with their plain-torch
references, the rounding error stays within its bound, and quantising a model keeps its
logits close to the full-precision ones."""

from __future__ import annotations

import pytest
import torch
import transformers

from specmoe.config import ModelConfig, SpeculativeConfig
from specmoe.layers.quantization import (Int4Linear, Int8Linear, can_int4, int4_dequantize,
                                         int4_linear_reference, quantize_int4,
                                         quantize_linear, quantize_model)
from specmoe.loader.model_loader import load_model
from specmoe.worker.model_runner import ModelRunner


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _weight(n: int, k: int, dtype=torch.float32) -> torch.Tensor:
    torch.manual_seed(n * 7 + k)
    return (torch.randn(n, k) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int8_fused_matches_reference(dtype, rows):
    w, b = _weight(128, 96, dtype), torch.randn(128).to(dtype)
    layer = Int8Linear.from_weight(w, b)
    x = torch.randn(rows, 96).to(dtype)
    tol = 3e-2  # both round activations (and the kernel its output) to bfloat16
    torch.testing.assert_close(layer(x), layer.forward_reference(x), atol=tol, rtol=tol)


def test_int8_rounding_error_within_half_a_step():
    w = _weight(64, 80)
    layer = Int8Linear.from_weight(w, None)
    deq = layer.qweight.float() * layer.scales.float()[:, None]
    assert ((deq - w).abs() <= layer.scales.float()[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 17])
def test_int4_fused_matches_reference(dtype, rows):
    w, b = _weight(128, 64, dtype), torch.randn(128).to(dtype)
    q, sz = quantize_int4(w, 32)
    layer = Int4Linear(q, sz, 32, b)
    x = torch.randn(rows, 64).to(dtype)
    tol = 3e-2  # both round activations (and the kernel its output) to bfloat16
    torch.testing.assert_close(layer(x), int4_linear_reference(x, q, sz, 32, b),
                               atol=tol, rtol=tol)


def test_int4_rounding_error_within_half_a_step():
    w = _weight(64, 128)
    q, sz = quantize_int4(w, 32)
    assert q.min() >= 0 and q.max() <= 15
    step = sz[..., 0].float().t().repeat_interleave(32, dim=1)  # [out, in]
    zero = sz[..., 1].float().t().repeat_interleave(32, dim=1)
    # Half a step, plus what rounding the stored zero to bfloat16 can shift the grid by.
    bound = step / 2 + zero.abs() * 2.0 ** -8 + 1e-7
    assert ((int4_dequantize(q, sz, 32, torch.float32) - w).abs() <= bound).all()


def test_int4_rejects_untileable_shapes_and_quantize_linear_falls_back():
    w = _weight(40, 64)  # 40 output channels: not a multiple of 64
    assert not can_int4(w)
    with pytest.raises(ValueError, match="int4 needs"):
        quantize_int4(w)
    assert isinstance(quantize_linear(w, None, "int4"), Int8Linear)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linear(w, None, "int3")


def test_bad_quantization_names_are_rejected():
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig("x", quantization="fp8")
    with pytest.raises(ValueError, match="draft_quantization"):
        SpeculativeConfig("draft", draft_model="x", draft_quantization="int2")


@pytest.mark.parametrize("method,max_err", [("int8", 0.02), ("int4", 0.3)])
def test_quantized_model_logits_stay_close(tiny_dir, method, max_err):
    ids = list(range(3, 40))
    full = ModelRunner(load_model(ModelConfig(tiny_dir)))
    quant = ModelRunner(load_model(ModelConfig(tiny_dir, quantization=method)))
    ref = full.forward(full.new_cache(64), ids)
    out = quant.forward(quant.new_cache(64), ids)
    kinds = {type(m).__name__ for m in quant.model.modules()}
    assert ("Int4Linear" if method == "int4" else "Int8Linear") in kinds
    assert "Linear" not in kinds  # every dense projection, the LM head too, was replaced
    err = (out - ref).abs().max().item()
    assert 0 < err < max_err, err


def test_quantize_model_keeps_routers_in_full_precision(tmp_path):
    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      moe_intermediate_size=64,
                                      shared_expert_intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = load_model(ModelConfig(str(tmp_path))).model
    quantize_model(model, "int8")
    mlp = model.layers[0].mlp
    assert type(mlp.router.gate).__name__ == "Linear"
    assert type(mlp.shared_expert_gate).__name__ == "Linear"
    assert type(mlp.shared_expert.gate_up_proj).__name__ == "Int8Linear"


def test_quantized_draft_keeps_greedy_output_lossless(tiny_dir):
    from specmoe import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_dir).generate([[5, 6, 7, 8]], sp)[0]
    spec = LLM(tiny_dir, speculative={"method": "draft", "draft_model": tiny_dir,
                                      "num_speculative_tokens": 3,
                                      "draft_quantization": "int4"})
    out = spec.generate([[5, 6, 7, 8]], sp)[0]
    assert out.token_ids == plain.token_ids
    assert out.spec_stats.num_draft_tokens > 0
