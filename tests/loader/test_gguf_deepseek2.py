"""DeepSeek-V2/V3 from llama.cpp `deepseek2` GGUF files: tiny random transformers models written
as llama.cpp's converter would (tests/loader/gguf_writer_deepseek2.py), loaded by specmoe and
compared with specmoe's load of the same model's HuggingFace directory (float32)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf_writer import hf_checkpoint_state_dict
from gguf_writer_deepseek2 import _split_kv_b, write_deepseek2_gguf
from tiny_models import deepseek_config

from specmoe import LLM, SamplingParams
from specmoe.config import ModelConfig
from specmoe.loader.gguf_deepseek2 import deepseek2_config, merge_kv_b
from specmoe.loader.gguf_file import GGUFCheckpoint
from specmoe.loader.model_loader import load_model
from specmoe.models.deepseek import parse_config
from specmoe.worker.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 160
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
             initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# llama.cpp keeps one YaRN mscale (yarn_log_multiplier): DeepSeek's releases set mscale ==
# mscale_all_dim. The betas are not the defaults (32, 1); beta_slow 2 moves one of the 4
# rotary frequencies here, so dropping it would change the logits too.
_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=0.707,
             mscale_all_dim=0.707, beta_fast=16, beta_slow=2, rope_theta=10000.0)
# case -> (tiny_models case, extra config, split kv_b into attn_k_b/attn_v_b)
_CASES = {
    "v3_yarn_split": ("deepseek_v3", dict(rope_parameters=_YARN), True),
    "v2_group_limited_split": ("deepseek_v2_group_limited", {}, True),
    "v2_lite_kv_b": ("deepseek_v2_lite", {}, False),
}


@dataclass
class Written:
    case: str
    hf_model: transformers.PreTrainedModel
    hf_dir: Path
    gguf_path: Path


def _model(case: str) -> transformers.PreTrainedModel:
    tiny_case, extra, _ = _CASES[case]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        deepseek_config(tiny_case, **extra, **_BASE), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # zero at init: give V3's score-correction bias a say
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(0.1 * torch.randn_like(buffer))
    return hf.eval()


@pytest.fixture(scope="module", params=list(_CASES))
def written(request, tmp_path_factory) -> Written:
    case = request.param
    hf = _model(case)
    hf_dir = tmp_path_factory.mktemp(case)
    hf.save_pretrained(hf_dir)
    gguf_path = hf_dir.parent / f"{case}.gguf"
    write_deepseek2_gguf(hf, gguf_path, split_kv_b=_CASES[case][2])
    return Written(case, hf, hf_dir, gguf_path)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_same_arch_config_as_the_hf_directory(written: Written):
    from_gguf = parse_config(GGUFCheckpoint(written.gguf_path).hf_config)
    from_dir = parse_config(written.hf_model.config.to_dict() | {
        "architectures": [type(written.hf_model).__name__]})
    # the tiny GGUF tokenizer has its own special tokens (bos = eos = 0)
    skip = {"bos_token_id", "eos_token_ids"}
    got = {k: v for k, v in dataclasses.asdict(from_gguf).items() if k not in skip}
    want = {k: v for k, v in dataclasses.asdict(from_dir).items() if k not in skip}
    assert got == want


def test_tensors_are_the_hf_checkpoint(written: Written):
    expected = hf_checkpoint_state_dict(written.hf_model)
    got = dict(GGUFCheckpoint(written.gguf_path).iter_tensors(torch.float32))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_logits_equal_the_hf_directory_load(written: Written):
    ids = _ids(1, 24)
    logits = []
    for path in (written.hf_dir, written.gguf_path):
        runner = ModelRunner(load_model(ModelConfig(str(path), dtype="float32", device="cpu")))
        cache = runner.new_cache(24)
        logits.append(torch.cat([runner.forward(cache, chunk)
                                 for chunk in (ids[:17], ids[17:18], ids[18:])]))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-6)


def test_greedy_continuation_equals_the_hf_directory_load(written: Written):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = _ids(2, 9)
    outputs = [LLM(str(path), dtype="float32", device="cpu").generate([prompt], params)[0].token_ids
               for path in (written.hf_dir, written.gguf_path)]
    assert outputs[1] == outputs[0]
    assert len(set(outputs[0])) > 1  # not one token repeated


@pytest.fixture(scope="module")
def v3_model() -> transformers.PreTrainedModel:
    return _model("v3_yarn_split")


@pytest.mark.parametrize("key", ["deepseek2.attention.kv_lora_rank", "deepseek2.rope.dimension_count",
                                 "deepseek2.attention.value_length_mla", "deepseek2.expert_feed_forward_length"])
def test_missing_metadata_key_is_named(v3_model, tmp_path, key):
    path = tmp_path / "m.gguf"
    write_deepseek2_gguf(v3_model, path, omit=[key])
    with pytest.raises(ValueError, match=f"m.gguf: missing GGUF metadata '{key}'"):
        load_model(ModelConfig(str(path), dtype="float32", device="cpu"))


def test_k_b_without_v_b_is_named(v3_model, tmp_path):
    path = tmp_path / "m.gguf"
    write_deepseek2_gguf(v3_model, path, omit=["blk.1.attn_v_b.weight"])
    with pytest.raises(ValueError, match=r"blk\.1\.attn_k_b\.weight without blk\.1\.attn_v_b\.weight"):
        GGUFCheckpoint(path)


# ---------------------------------------------------------------- metadata and kv_b units


def _read(metadata: dict):
    """(key, required) over `deepseek2.`-less metadata keys, as GGUFCheckpoint passes them."""
    def key(suffix, default=None):
        return metadata.get(suffix, default)

    def required(suffix):
        if suffix not in metadata:
            raise ValueError(f"missing GGUF metadata 'deepseek2.{suffix}'")
        return metadata[suffix]
    return key, required


_V2_LEGACY = {"attention.head_count": 16, "attention.kv_lora_rank": 512, "rope.dimension_count": 64,
              "attention.key_length": 192, "attention.value_length": 128, "expert_count": 64,
              "expert_used_count": 6, "expert_feed_forward_length": 1408, "expert_shared_count": 2,
              "leading_dense_block_count": 1}


def test_v2_file_without_gating_key_is_deepseek_v2_greedy():
    """DeepSeek-V2-Lite as converted before llama.cpp wrote the MLA lengths and gating key."""
    config = deepseek2_config("x.gguf", *_read(_V2_LEGACY), None)
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (config["q_lora_rank"], config["qk_nope_head_dim"], config["v_head_dim"]) == (None, 128, 128)
    assert (config["num_key_value_heads"], config["head_dim"]) == (16, 64)
    assert (config["scoring_func"], config["topk_method"], config["norm_topk_prob"]) == ("softmax", "greedy", False)
    assert (config["n_shared_experts"], config["first_k_dense_replace"]) == (2, 1)
    assert config["routed_scaling_factor"] == 1.0


def test_v3_file_with_groups_and_yarn():
    metadata = _V2_LEGACY | {
        "attention.q_lora_rank": 1536, "attention.key_length": 576, "attention.value_length": 512,
        "attention.key_length_mla": 192, "attention.value_length_mla": 128, "expert_gating_func": 2,
        "expert_group_count": 8, "expert_group_used_count": 4, "expert_weights_norm": True,
        "expert_weights_scale": 2.5, "rope.scaling.yarn_log_multiplier": 0.1,
        "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0}
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
    config = deepseek2_config("x.gguf", *_read(metadata), yarn)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["rope_interleave"]
    assert (config["qk_nope_head_dim"], config["v_head_dim"], config["q_lora_rank"]) == (128, 128, 1536)
    assert (config["topk_method"], config["n_group"], config["topk_group"]) == ("noaux_tc", 8, 4)
    assert (config["norm_topk_prob"], config["routed_scaling_factor"]) == (True, 2.5)
    assert config["rope_scaling"] == yarn | {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                             "mscale_all_dim": 1.0}
    grouped_v2 = deepseek2_config("x.gguf", *_read(_V2_LEGACY | {
        "expert_gating_func": 1, "expert_group_count": 8, "expert_group_used_count": 3}), None)
    assert (grouped_v2["topk_method"], grouped_v2["topk_group"]) == ("group_limited_greedy", 3)


def test_unknown_gating_function_is_named():
    with pytest.raises(ValueError, match="'deepseek2.expert_gating_func' 3"):
        deepseek2_config("x.gguf", *_read(_V2_LEGACY | {"expert_gating_func": 3}), None)


def test_merge_kv_b_inverts_the_converters_split():
    config = transformers.DeepseekV3Config(num_attention_heads=3, qk_nope_head_dim=4, v_head_dim=5, kv_lora_rank=6)
    kv_b = np.random.default_rng(0).standard_normal((3 * (4 + 5), 6)).astype(np.float32)
    k_b, v_b = _split_kv_b(kv_b, config)
    assert k_b.shape == (3, 6, 4) and v_b.shape == (3, 5, 6)
    np.testing.assert_array_equal(merge_kv_b(k_b, v_b), kv_b)
    with pytest.raises(ValueError, match="do not split one kv_b"):
        merge_kv_b(k_b[:, :5], v_b)
