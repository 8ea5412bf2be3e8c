"""Study presets written as random-weight HuggingFace checkpoints (`specmoe models synth`):
specmoe and transformers load them with the same logits, the engine serves them, the seed
decides the weights, and presets the layout cannot express are refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from specmoe import LLM, SamplingParams
from specmoe.analysis.preset_export import export_preset, hf_config
from specmoe.analysis.presets import PRESETS, Preset
from specmoe.config import ModelConfig
from specmoe.loader.aliases import resolve_model_path
from specmoe.loader.model_loader import load_model
from specmoe.worker.model_runner import ModelRunner

SMALL_MOE = Preset("small-moe", "test", num_experts=8, top_k=2, intermediate_size=32,
                   num_layers=2, hidden_size=256)
SMALL_DENSE = Preset("small-dense", "test", 0, 0, 64, num_layers=2, hidden_size=256)


@pytest.fixture(scope="module")
def tokenizer_dir():
    return resolve_model_path("tiny-moe")


@pytest.mark.parametrize("preset,architecture", [(SMALL_MOE, "MixtralForCausalLM"),
                                                 (SMALL_DENSE, "LlamaForCausalLM")])
def test_export_loads_in_specmoe_and_transformers_alike(tmp_path, tokenizer_dir, preset,
                                                        architecture):
    out = export_preset(preset, tmp_path / preset.name, tokenizer_dir, seed=3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= 4096
    assert len(list(out.glob("*.safetensors"))) == preset.num_layers + 1
    runner = ModelRunner(load_model(ModelConfig(str(out), dtype="float32", device="cpu")))
    if preset.is_moe:
        assert runner.arch.moe.num_experts == 8 and runner.arch.moe.top_k == 2
    ids = [5, 99, 1000, 17, 4000, 3, 250, 8]
    ours = runner.forward(runner.new_cache(len(ids)), ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_exported_moe_serves_with_speculation_losslessly(tmp_path, tokenizer_dir):
    out = export_preset(SMALL_MOE, tmp_path / "moe", tokenizer_dir)
    llm = LLM(str(out), dtype="float32",
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    plain = LLM(str(out), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["def add(a, b):", "The capital of France"]
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]


def test_the_seed_decides_the_weights(tmp_path, tokenizer_dir):
    a = export_preset(SMALL_MOE, tmp_path / "a", tokenizer_dir, seed=1)
    b = export_preset(SMALL_MOE, tmp_path / "b", tokenizer_dir, seed=1)
    c = export_preset(SMALL_MOE, tmp_path / "c", tokenizer_dir, seed=2)
    name = "model-00001-of-00003.safetensors"
    ta, tb, tc = (load_file(str(d / name)) for d in (a, b, c))
    key = "model.layers.0.block_sparse_moe.experts.5.w2.weight"
    assert torch.equal(ta[key], tb[key]) and not torch.equal(ta[key], tc[key])
    assert ta[key].dtype is torch.bfloat16 and ta[key].abs().max() < 3


def test_presets_mixtral_cannot_express_are_refused(tmp_path, tokenizer_dir, capsys):
    with pytest.raises(ValueError, match="deepseek-256x8"):
        hf_config(PRESETS["deepseek-256x8"], 4096)
    from specmoe.entrypoints.cli import main
    assert main(["models", "synth", "deepseek-256x8", "--out", str(tmp_path / "x")]) == 1
    assert "cannot express" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
