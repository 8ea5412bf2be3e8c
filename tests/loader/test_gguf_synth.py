"""`models synth --like NAME`: GGUF files of real models' shapes with random weights. The
full shapes hold their published parameter counts; the same layouts, shrunk, are written,
load through the GGUF loader as their families, decode text, and speculate losslessly."""

from __future__ import annotations

import gguf
import pytest

from specmoe import LLM, SamplingParams
from specmoe.entrypoints.cli import main
from specmoe.loader.aliases import resolve_model_path
from specmoe.loader.gguf_synth import LIKE, TYPES, active_params, plan_tensors, shape_like

# total and active parameters (active counting the embedding row as free) as published
PUBLISHED = {"qwen3-30b-a3b": (30.5e9, 3.0e9), "olmoe-1b-7b": (6.9e9, 1.2e9),
             "mixtral-8x7b": (46.7e9, 12.7e9)}
FAMILY = {"qwen3-30b-a3b": "Qwen3MoeForCausalLM", "olmoe-1b-7b": "OlmoeForCausalLM",
          "mixtral-8x7b": "MixtralForCausalLM"}


@pytest.mark.parametrize("name", sorted(LIKE))
def test_full_shapes_hold_their_published_parameter_counts(name):
    shape = shape_like(name)
    total = sum(t.num_params for t in plan_tensors(shape, TYPES["Q8_0"]))
    assert total == pytest.approx(PUBLISHED[name][0], rel=0.01)
    assert active_params(shape) == pytest.approx(PUBLISHED[name][1], rel=0.03)


def _small(name: str):
    heads = 4
    return shape_like(name, vocab_size=49152, hidden_size=64, num_layers=2, num_heads=heads,
                      num_kv_heads=heads if LIKE[name].num_kv_heads == LIKE[name].num_heads
                      else 2, head_dim=16, intermediate_size=64, context_length=256,
                      num_experts=8, top_k=2, expert_ffn=32 if LIKE[name].expert_ffn else 0)


@pytest.mark.parametrize("name,qtype", [("qwen3-30b-a3b", "Q8_0"), ("olmoe-1b-7b", "Q4_0"),
                                        ("mixtral-8x7b", "F16")])
def test_shrunk_files_load_as_their_family_and_speculate_losslessly(smollm2, tmp_path, name,
                                                                      qtype):
    from specmoe.loader.gguf_synth import write_like
    path = write_like(_small(name), qtype, tmp_path / f"{name}.gguf",
                      resolve_model_path(smollm2))
    reader = gguf.GGUFReader(path)
    matrices = {t.name: t.tensor_type for t in reader.tensors}
    assert matrices["blk.0.ffn_gate_exps.weight"] == TYPES[qtype]
    assert matrices["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    llm = LLM(str(path), dtype="float32")
    arch = llm.target.arch
    assert arch.architecture == FAMILY[name] and arch.moe.num_experts == 8
    assert arch.qk_norm == LIKE[name].qk_norm
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = llm.generate("The history of the", params)[0]
    assert len(plain.token_ids) == 12 and isinstance(plain.text, str)
    spec = llm.with_speculative({"method": "ngram", "num_speculative_tokens": 3})
    assert spec.generate("The history of the", params)[0].token_ids == plain.token_ids


def test_cli_writes_a_first_look_and_refuses_bad_settings(smollm2, tmp_path, capsys):
    with pytest.raises(SystemExit):  # argparse refuses the choice, naming the K-quant
        main(["models", "synth", "--like", "olmoe-1b-7b", "--out", str(tmp_path / "x"),
              "--type", "Q5_K"])
    assert main(["models", "synth", "--out", str(tmp_path)]) == 2
    assert "a PRESET or --like NAME" in capsys.readouterr().err
    assert main(["models", "synth", "--like", "olmoe-1b-7b", "--layers", "0",
                 "--out", str(tmp_path / "o.gguf")]) == 2
    assert "invalid --layers=0" in capsys.readouterr().err
