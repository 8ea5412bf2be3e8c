"""DeepSeek-V2/V3 beyond what tests/models/test_families_vs_transformers.py checks for
every family (logits over prefill, chunks, rollback and paged batches; greedy output;
lossless n-gram and draft speculation, all in float32): the same experts per token and
layer as transformers, the latent KV cache's size, the absorbed and decompressed attention
agreeing in a whole model, bf16 (speculation lossless there too, the fused native driver
declining MLA) and the config checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from specmoe import LLM, SamplingParams
from specmoe.config import ModelConfig
from specmoe.layers.mla import MLAttention
from specmoe.layers.moe.backends import expert_stats
from specmoe.layers.paged_attention import AttentionMetadata, SequenceSlice
from specmoe.loader.model_loader import load_model
from specmoe.models.deepseek import parse_config
from specmoe.worker.kv_cache import PagedKVCache
from specmoe.worker.model_runner import ModelRunner
from tiny_models import deepseek_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 160
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
             max_position_embeddings=256, initializer_range=0.1, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


@dataclass
class Saved:
    case: str
    path: Path
    hf_model: transformers.PreTrainedModel


def _save(case: str, path: Path) -> Saved:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        deepseek_config(case, **_BASE), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    hf.eval().save_pretrained(path)
    return Saved(case, path, hf)


@pytest.fixture(scope="module", params=["deepseek_v2_group_limited", "deepseek_v3"])
def saved(request, tmp_path_factory) -> Saved:
    return _save(request.param, tmp_path_factory.mktemp(request.param))


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Routing:
    def __init__(self) -> None:
        self.ids: dict[int, list[torch.Tensor]] = {}

    def record(self, layer_idx, topk_ids, topk_weights) -> None:
        self.ids.setdefault(layer_idx, []).append(topk_ids.sort(dim=-1).values)


def test_same_experts_per_token_and_layer_as_transformers(saved: Saved):
    ids = _ids(1, 24)
    hf_ids = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, args, out, i=i: hf_ids.__setitem__(i, out[2].sort(dim=-1).values))
        for i, layer in enumerate(saved.hf_model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        saved.hf_model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    runner = ModelRunner(load_model(ModelConfig(str(saved.path), dtype="float32",
                                                device="cpu")))
    routing = _Routing()
    expert_stats(runner.model).subscribe(routing)
    cache = runner.new_cache(24)
    for chunk in (ids[:17], ids[17:21], ids[21:22], ids[22:]):
        runner.forward(cache, chunk)
    assert sorted(routing.ids) == sorted(hf_ids) == [1, 2]
    for layer, chunks in routing.ids.items():
        ours = torch.cat(chunks)
        assert torch.equal(ours, hf_ids[layer]), f"layer {layer}"
        assert len(ours.unique()) > 2  # tokens do not all pick the same experts


def test_cache_holds_the_latent_only(saved: Saved):
    arch = load_model(ModelConfig(str(saved.path), dtype="float32", device="cpu")).arch
    latent = 32 + 8  # kv_lora_rank + qk_rope_head_dim
    cache = PagedKVCache(arch, num_blocks=5, block_size=16, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    assert len(cache.layers) == 3
    assert all(len(layer) == 1 and layer[0].shape == (5 * 16, latent) for layer in cache.layers)
    per_block = PagedKVCache.bytes_per_block(arch, 16, torch.bfloat16)
    assert per_block == 3 * 16 * latent * 2
    assert cache.num_bytes == 5 * per_block
    # grouped-query attention with these heads would cache 2 * 4 heads * 24 dims per token
    assert latent < 2 * 4 * (16 + 8)


def test_absorbed_and_decompressed_models_agree(saved: Saved):
    runner = ModelRunner(load_model(ModelConfig(str(saved.path), dtype="float32",
                                                device="cpu")))
    ids = _ids(2, 30)
    chunks = [20, 1, 5, 4]  # prefill, decode, a verification window, another
    results = []
    for absorb in (True, False):
        for layer in runner.model.layers:
            layer.attn.absorb = absorb
        cache = runner.new_cache(30)
        out, start = [], 0
        for n in chunks:
            out.append(runner.forward(cache, ids[start:start + n]))
            start += n
        results.append(torch.cat(out))
    torch.testing.assert_close(results[0], results[1], atol=2e-5, rtol=0)


def _prompt() -> list[int]:
    half = _ids(3, 6)
    return half + _ids(4, 2) + half


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculation_is_lossless(saved: Saved, dtype: str):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(saved.path), dtype=dtype, device="cpu")
    (want,) = plain.generate([_prompt()], params)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft", "draft_model": str(saved.path),
                  "num_speculative_tokens": 3}):
        (got,) = plain.with_speculative(spec).generate([_prompt()], params)
        assert got.token_ids == want.token_ids, spec["method"]
        assert got.spec_stats.num_accepted_tokens > 0, spec["method"]


def test_bf16_runs_without_the_fused_driver(saved: Saved):
    """bf16 on CPU: logits near float32's, and the fused driver declines the MLA layers
    (its kernels read per-head key/value caches, not latents)."""
    ids = _ids(5, 12)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(ModelConfig(str(saved.path), dtype=dtype, device="cpu"))
        runner = ModelRunner(loaded)
        logits[dtype] = runner.forward(runner.new_cache(12), ids)
    assert torch.isfinite(logits["bfloat16"]).all()
    top = logits["float32"].argmax(-1)
    assert (logits["bfloat16"].argmax(-1) == top).float().mean() > 0.7
    model = loaded.model
    assert all(type(layer.attn) is MLAttention for layer in model.layers)
    cache = PagedKVCache(loaded.arch, 1, 16, torch.bfloat16, torch.device("cpu"))
    meta = AttentionMetadata.build([SequenceSlice(0, 2, [0])], 16, "cpu")
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert model.fused_layers.try_run(model, x, torch.arange(2), cache.layers, meta) is None


def _hf_dict(case: str, **changes) -> dict:
    cfg = deepseek_config(case, **_BASE).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM" if "v3" in case
                            else "DeepseekV2ForCausalLM"]
    cfg.update(changes)
    return cfg


def test_config_parsing():
    arch = parse_config(_hf_dict("deepseek_v3"))
    moe = arch.moe
    assert (arch.mla.q_lora_rank, arch.mla.kv_lora_rank, arch.mla.rope_interleave) == \
        (48, 32, True)
    assert (arch.head_dim, arch.num_key_value_heads) == (8, 4)
    assert moe.moe_layers == [1, 2] and moe.shared_expert_intermediate_size == 32
    assert not moe.has_shared_expert_gate
    assert (moe.scoring_func, moe.topk_method, moe.n_group, moe.topk_group,
            moe.norm_topk_prob, moe.routed_scaling_factor) == \
        ("sigmoid", "noaux_tc", 2, 1, True, 2.5)
    v2 = parse_config(_hf_dict("deepseek_v2_lite", moe_layer_freq=2, n_shared_experts=2))
    assert v2.mla.q_lora_rank is None and v2.mla.rope_interleave
    assert (v2.moe.scoring_func, v2.moe.topk_method, v2.moe.norm_topk_prob) == \
        ("softmax", "greedy", False)
    assert v2.moe.moe_layers == [2]  # DeepSeek's rule: i >= first_k and i % freq == 0
    assert v2.moe.shared_expert_intermediate_size == 64
    halves = parse_config(_hf_dict("deepseek_v3_yarn_halves"))
    assert not halves.mla.rope_interleave and halves.rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize("case, changes, match", [
    ("deepseek_v2_lite", dict(norm_topk_prob=True), "norm_topk_prob=true"),
    ("deepseek_v2_lite", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("deepseek_v2_lite", dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    ("deepseek_v3", dict(topk_method="greedy"), "topk_method='greedy'"),
    ("deepseek_v3", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("deepseek_v3", dict(kv_lora_rank=None), "kv_lora_rank"),
    ("deepseek_v3", dict(qk_rope_head_dim=7), "qk_rope_head_dim=7"),
])
def test_unsupported_configs_name_the_value(case, changes, match):
    with pytest.raises(ValueError, match=match):
        parse_config(_hf_dict(case, **changes))

