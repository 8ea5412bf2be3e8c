"""`specmoe models carve` (issue 25): the dense forward the carver uses equals transformers';
carving into N experts with k = N reproduces the dense logits; a trained carve loads in
transformers and in specmoe with the same logits; it is deterministic and resumable; greedy
speculation on it is lossless. Sources: the bundled tiny-moe-draft (a real trained Llama
with a tokenizer) and a random Qwen2 (q/k/v biases) using that tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from carve_sources import DRAFT, FAST

from specmoe import LLM, SamplingParams
from specmoe.carve import dense, evaluate
from specmoe.carve.carve import CarveSettings, carve
from specmoe.carve.train import TrainSettings
from specmoe.config import ModelConfig
from specmoe.loader.aliases import bundled_path
from specmoe.loader.model_loader import load_model
from specmoe.worker.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    """A random Qwen2 (q/k/v biases, untied head) with tiny-moe-draft's tokenizer."""
    src = bundled_path(DRAFT)
    vocab = transformers.AutoConfig.from_pretrained(src).vocab_size
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.1, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return path


def _sources(qwen2_dir: Path) -> dict[str, str]:
    return {"llama": DRAFT, "qwen2": str(qwen2_dir)}


def _hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits.float()


def _ids(n: int = 2, s: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 400, (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_dense_forward_matches_transformers(which, qwen2_dir):
    source = _sources(qwen2_dir)[which]
    ckpt = dense.load_dense(source)
    ids = _ids()
    torch.testing.assert_close(dense.forward(ckpt, ids), _hf_logits(ckpt.path, ids),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("which,n,shared", [("llama", 4, 0), ("qwen2", 2, 2)])
def test_k_equal_n_reproduces_the_dense_logits(which, n, shared, qwen2_dir, tmp_path):
    """Every expert selected, no training: the slices sum back to the dense FFN."""
    source = _sources(qwen2_dir)[which]
    settings = CarveSettings(num_experts=n, top_k=n, shared_experts=shared, dtype="float32",
                             train=TrainSettings(steps=0), **FAST)
    carve(source, tmp_path, settings, progress=False)
    ids = _ids()
    want = dense.forward(dense.load_dense(source), ids)
    torch.testing.assert_close(_hf_logits(tmp_path, ids), want, atol=1e-4, rtol=0)


def test_carved_model_has_the_same_logits_in_transformers_and_specmoe(trained):
    ids = _ids(1, 24)
    ref = _hf_logits(trained, ids)[0]
    loaded = load_model(ModelConfig(str(trained), dtype="float32", device="cpu"))
    assert loaded.arch.moe.num_experts == 12 and loaded.arch.moe.top_k == 4
    assert loaded.arch.moe.shared_expert_intermediate_size == 4 * 512 // 16
    runner = ModelRunner(loaded)
    ours = runner.forward(runner.new_cache(24), ids[0].tolist())
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_carver_evaluation_computes_the_written_model(trained):
    """The carver's own float32 MoE (what it reports perplexity with) is the checkpoint's."""
    from safetensors.torch import load_file
    from specmoe.carve.moe_layer import CarvedMoE
    tensors = load_file(str(trained / "model.safetensors"))
    carved = {i: CarvedMoE.from_hf_tensors(tensors, f"model.layers.{i}.mlp.", 12, 4)
              for i in range(2)}
    ids = _ids(1, 24)
    ckpt = dense.load_dense(DRAFT)
    got = dense.forward(ckpt, ids, evaluate.carved_ffn(carved))
    torch.testing.assert_close(got, _hf_logits(trained, ids), atol=1e-4, rtol=0)
    dense_q, carved_q = evaluate.quality(ckpt, _ids(2, 32, seed=3), carved)
    assert dense_q.perplexity > 1 and carved_q.perplexity > 1
    assert 0 <= carved_q.argmax_agreement <= 1


def test_carve_is_deterministic_and_resumes(tmp_path):
    settings = CarveSettings(num_experts=6, top_k=2, shared_experts=2,
                             train=TrainSettings(steps=5, batch=64), **FAST)
    carve(DRAFT, tmp_path / "a", settings, progress=False)
    carve(DRAFT, tmp_path / "b", settings, progress=False)
    first = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == first
    # stop after layer 0: layer 1 is recomputed from the saved state, to the same bits
    for f in ("layer_001.safetensors", "layer_001.json"):
        (tmp_path / "a" / ".carve" / f).unlink()
    (tmp_path / "a" / "model.safetensors").unlink()
    carve(DRAFT, tmp_path / "a", settings, progress=False)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == first
    other = CarveSettings(num_experts=6, top_k=3, shared_experts=2, **FAST)
    with pytest.raises(ValueError, match="other settings"):
        carve(DRAFT, tmp_path / "a", other, progress=False)


def test_carving_some_layers_keeps_the_others_dense(tmp_path):
    settings = CarveSettings(num_experts=4, top_k=2, layers=(1,),
                             train=TrainSettings(steps=0), **FAST)
    carve(DRAFT, tmp_path, settings, progress=False)
    loaded = load_model(ModelConfig(str(tmp_path), dtype="float32", device="cpu"))
    assert loaded.arch.moe.moe_layers == [1]


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts=5, top_k=2), "into 5 experts .* S \\+ N must divide it"),
    (dict(num_experts=100000, top_k=2), "into 100000 experts"),
    (dict(num_experts=4, top_k=2, shared_experts=100), r"104 experts \(100 shared"),
    (dict(num_experts=4, top_k=2, layers=(7,)), r"layers \[7\] out of range"),
])
def test_bad_carves_fail_before_the_model_is_read_and_leave_no_claim(kw, match, tmp_path,
                                                                   monkeypatch):
    """Found from the config: no weight read, nothing written, so the corrected rerun
    into the same --out is not refused."""
    def no_load(source):
        raise AssertionError("the model was read before the settings were checked")
    with monkeypatch.context() as m:
        m.setattr(dense, "load_dense", no_load)
        with pytest.raises(ValueError, match=match):
            carve(DRAFT, tmp_path, CarveSettings(**kw, **FAST), progress=False)
    assert not (tmp_path / ".carve").exists()


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts=4, top_k=5), "top_k=5"),
    (dict(num_experts=1, top_k=1), "num_experts=1: must be >= 2"),
    (dict(num_experts=4, top_k=2, window=0), "window=0"),
    (dict(num_experts=4, top_k=2, calibration_windows=0), "calibration_windows=0"),
])
def test_bad_settings_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        CarveSettings(**{**FAST, **kw})


@pytest.mark.parametrize("kw,match", [(dict(steps=-1), "steps=-1"), (dict(batch=0), "batch=0"),
                                      (dict(lr=0.0), "lr=0.0")])
def test_bad_train_settings_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainSettings(**kw)


def test_out_naming_a_file_and_negative_eval_windows(tmp_path):
    settings = CarveSettings(num_experts=4, top_k=2, **FAST)
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(ValueError, match="is a file"):
        carve(DRAFT, file, settings, progress=False)
    with pytest.raises(ValueError, match="eval windows per file=-1"):
        carve(DRAFT, tmp_path / "o", settings, progress=False, eval_windows_per_file=-1)


def test_a_claim_without_a_finished_layer_is_taken_over(tmp_path):
    from specmoe.carve.carve import _claim
    state = tmp_path / ".carve"
    _claim(state, DRAFT, CarveSettings(num_experts=4, top_k=2, **FAST))
    mine = CarveSettings(num_experts=4, top_k=1, **FAST)
    _claim(state, DRAFT, mine)  # the first never finished a layer
    (state / "layer_000.safetensors").write_bytes(b"")
    _claim(state, DRAFT, mine)
    with pytest.raises(ValueError, match="holds a carve with other settings"):
        _claim(state, DRAFT, CarveSettings(num_experts=4, top_k=2, **FAST))


def test_greedy_speculation_on_a_carved_model_is_lossless(trained, tmp_path):
    """bf16 (the fused MoE path on CPUs with the kernels), n-gram and the dense original as
    the draft model; a single request and a batch."""
    carve_bf16 = tmp_path / "bf16"
    shutil.copytree(trained, carve_bf16, ignore=shutil.ignore_patterns(".carve"))
    llm = LLM(str(carve_bf16), dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def add(a, b):\n    return", "The cat sat on the", "1, 2, 3, 4,",
               "import numpy as np\n"]
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "draft", "draft_model": DRAFT, "num_speculative_tokens": 3}):
        spec_llm = LLM(str(carve_bf16), dtype="bfloat16", speculative=spec)
        assert [o.token_ids for o in spec_llm.generate(prompts, params)] == plain
        assert spec_llm.generate(prompts[0], params)[0].token_ids == plain[0]


def test_cli_carves_and_reports_held_out_quality(tmp_path, capsys):
    import json
    from specmoe.entrypoints.cli import main
    out = tmp_path / "cli"
    rc = main(["models", "carve", DRAFT, "--num-experts", "6", "--top-k", "2",
               "--shared-experts", "2", "--out", str(out), "--calibration-windows", "6",
               "--window", "64", "--train-steps", "5", "--eval-windows", "1",
               "--no-progress", "--dtype", "float32"])
    assert rc == 0 and capsys.readouterr().out.strip() == str(out)
    report = json.loads((out / "carve.json").read_text())
    assert report["settings"]["num_experts"] == 6 and len(report["layers"]) == 2
    quality = report["quality"]
    assert {"all", "arxiv", "wikipedia"} <= set(quality)
    assert quality["all"]["tokens"] == sum(q["tokens"] for k, q in quality.items()
                                           if k != "all")
    for q in quality.values():
        assert q["dense_perplexity"] > 1 and q["carved_perplexity"] > 1
        assert 0 <= q["argmax_agreement"] <= 1


def test_install_recipe_carves_into_the_cache_and_checks_the_hash(tmp_path, monkeypatch):
    from specmoe.carve import recipes
    from specmoe.loader import aliases
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path))
    settings = CarveSettings(num_experts=4, top_k=2, train=TrainSettings(steps=2), **FAST)
    monkeypatch.setitem(aliases.CARVED, "tiny-carve", aliases.CarvedAlias("tiny-carve", "t"))
    with pytest.raises(FileNotFoundError, match="specmoe models install t"):
        aliases.resolve_model_path("tiny-carve")
    recipe = recipes.Recipe("tiny-carve", (), DRAFT, settings, None, "")
    monkeypatch.setitem(recipes.RECIPES, "t", recipe)
    first = recipes.install_recipe("t", progress=False)
    assert first.path == tmp_path / "tiny-carve" and first.matches_record is None
    assert aliases.resolve_model_path("tiny-carve") == first.path
    assert first.sha256 == recipes.file_sha256(first.path / "model.safetensors")
    monkeypatch.setitem(recipes.RECIPES, "t", recipes.Recipe(
        "tiny-carve", (), DRAFT, settings, first.sha256, "here"))
    assert recipes.install_recipe("t", progress=False).matches_record is True
    monkeypatch.setitem(recipes.RECIPES, "t", recipes.Recipe(
        "tiny-carve", (), DRAFT, settings, "0" * 64, "elsewhere"))
    assert recipes.install_recipe("t", progress=False).matches_record is False
    with pytest.raises(ValueError, match="unknown carve recipe 'nope'"):
        recipes.install_recipe("nope")


@pytest.mark.slow
def test_smoke_carve_of_smollm2_serves_losslessly(smollm2, tmp_path):
    """The embedded default model, two of its 30 layers carved on a few calibration tokens:
    the checkpoint serves, and greedy n-gram speculation on it gives the plain tokens."""
    settings = CarveSettings(num_experts=12, top_k=4, shared_experts=4, layers=(3, 17),
                             train=TrainSettings(steps=10, batch=128), **FAST)
    reports = carve(smollm2, tmp_path, settings, progress=False)
    assert [r.layer for r in reports] == [3, 17]
    llm = LLM(str(tmp_path), dtype="bfloat16")
    assert llm.target.arch.moe.moe_layers == [3, 17]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "def fibonacci(n):\n    "
    plain = llm.generate(prompt, params)[0].token_ids
    spec = LLM(str(tmp_path), dtype="bfloat16",
               speculative={"method": "ngram", "num_speculative_tokens": 4})
    assert spec.generate(prompt, params)[0].token_ids == plain
