"""The bundled fixture models `tiny-moe` (OLMoE) and `tiny-moe-draft` (Llama), trained by
`tools/train_tiny_moe.py`: they load through our HuggingFace-directory loader by alias, match
`transformers` (logits, routing, greedy continuation) in float32, and greedy speculative
decoding with either proposer emits exactly the plain greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from kernel_checks import require_kernel
import torch
import transformers

from specmoe import LLM, SamplingParams
from specmoe.config import ModelConfig
from specmoe.layers.moe.backends import expert_stats
from specmoe.layers.moe.stats import ExpertStatsRecorder
from specmoe.loader.aliases import MODELS_DATA_DIR, all_aliases, resolve_model_path
from specmoe.loader.model_loader import LoadedModel, load_model
from specmoe.worker.model_runner import ModelRunner

TARGET, DRAFT = "tiny-moe", "tiny-moe-draft"
ATOL = 1e-4
TEXTS = [
    "The city council approved the new budget on Tuesday, and the mayor said that the",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "Die Stadt liegt am Ufer des Flusses und hat etwa zwanzigtausend Einwohner. Sie",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Pair:
    """One bundled model loaded by us and by transformers (fp32)."""

    alias: str
    loaded: LoadedModel
    runner: ModelRunner
    hf_model: transformers.PreTrainedModel
    tokenizer: object


@pytest.fixture(scope="module", params=[TARGET, DRAFT])
def pair(request) -> Pair:
    loaded = load_model(ModelConfig(request.param, dtype="float32", device="cpu"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(loaded.path), dtype=torch.float32, attn_implementation="eager").eval()
    return Pair(request.param, loaded, ModelRunner(loaded), hf_model, loaded.load_tokenizer())


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_aliases_resolve_to_bundled_directories():
    for alias in (TARGET, DRAFT):
        path = resolve_model_path(alias)
        assert path == MODELS_DATA_DIR / alias and (path / "config.json").is_file()
        assert alias in all_aliases()
        assert (path / "model.safetensors").stat().st_size < 30 * 2**20


def test_target_and_draft_share_one_tokenizer():
    files = [resolve_model_path(a) / "tokenizer.json" for a in (TARGET, DRAFT)]
    assert files[0].read_bytes() == files[1].read_bytes()


def test_shapes_are_a_fine_grained_moe_and_a_smaller_dense_draft():
    target = load_model(ModelConfig(TARGET, dtype="float32", device="cpu"))
    draft = load_model(ModelConfig(DRAFT, dtype="float32", device="cpu"))
    assert target.arch.architecture == "OlmoeForCausalLM" and target.arch.is_moe
    assert target.arch.moe.num_experts >= 32 and target.arch.moe.top_k >= 4
    assert draft.arch.architecture == "LlamaForCausalLM" and not draft.arch.is_moe
    assert target.arch.vocab_size == draft.arch.vocab_size
    num = lambda m: sum(p.numel() for p in m.model.parameters())  # noqa: E731
    assert num(target) > 4 * num(draft)


def test_tokenizer_round_trip_and_chat_template(pair: Pair):
    tok = pair.tokenizer
    for text in TEXTS + ["naïve café – 東京 😀"]:
        assert tok.decode(_ids(tok, text)) == text
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("text", TEXTS, ids=["prose", "code", "german"])
def test_logits_match_transformers(pair: Pair, text: str):
    runner, hf_model, tok = pair.runner, pair.hf_model, pair.tokenizer
    ids = _ids(tok, text)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]  # [T, vocab_size]
    cache = runner.new_cache(len(ids))
    ours = torch.cat([runner.forward(cache, ids[:7]), runner.forward(cache, ids[7:9]),
                      runner.forward(cache, ids[9:])])  # prefill, verification, rest
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_routing_matches_transformers(pair: Pair):
    """Our router picks the same top-k experts as transformers' in every layer."""
    if not pair.loaded.arch.is_moe:
        pytest.skip("dense model")
    ids = _ids(pair.tokenizer, TEXTS[0] + " " + TEXTS[1])
    with expert_stats(pair.loaded.model).subscribed(ExpertStatsRecorder()) as recorder:
        pair.runner.forward(pair.runner.new_cache(len(ids)), ids)
    with torch.no_grad():
        out = pair.hf_model(torch.tensor([ids]), output_router_logits=True)
    k = pair.loaded.arch.moe.top_k
    assert len(out.router_logits) == len(recorder.routing)
    for layer, logits in enumerate(out.router_logits):
        ref = torch.topk(logits, k, dim=-1).indices.sort(dim=-1).values  # [T, k]
        assert torch.equal(recorder.routing[layer][0].sort(dim=-1).values, ref)


def test_greedy_matches_transformers_generate(pair: Pair):
    llm = LLM(pair.alias, dtype="float32", device="cpu")
    ids = _ids(pair.tokenizer, TEXTS[0])
    ours = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    with torch.no_grad():
        ref = pair.hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                     min_new_tokens=24, pad_token_id=0)[0, len(ids):]
    assert ours[0].token_ids == ref.tolist()


@pytest.mark.parametrize("speculative", [
    {"method": "draft", "draft_model": DRAFT, "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 3},
], ids=["draft_model", "ngram"])
def test_greedy_identical_with_speculation(speculative):
    plain = LLM(TARGET, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(TEXTS, params)]
    outs = plain.with_speculative(speculative).generate(TEXTS, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec_stats.num_drafts for o in outs) > 0
    if speculative["method"] == "draft":  # a trained draft: mean acceptance length > 1.25
        accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
        assert accepted > 0.25 * sum(o.spec_stats.num_drafts for o in outs)


@pytest.mark.parametrize("moe_backend", ["grouped", "grouped_mm", "fused", "auto"])
def test_bf16_greedy_identical_with_speculation(moe_backend):
    """Lossless in bfloat16 too, on each MoE backend: a single request and a batch of 8 give
    the plain greedy tokens with the draft model and with n-gram, and the batch gives each
    prompt's tokens alone (a verification window must not change a token's expert sums)."""
    from specmoe.kernels import attention, gemv
    from specmoe.layers.moe.backends import MOE_BACKENDS, moe_blocks
    from specmoe.utils.data import load_prompts
    # bf16 sums are batch-invariant only in the native kernels (float32 is exact anywhere)
    require_kernel("bf16 linear kernel", gemv.kernel_unavailable_reason())
    require_kernel("attention kernel", attention.kernel_unavailable_reason())
    plain = LLM(TARGET, dtype="bfloat16", device="cpu", moe_backend=moe_backend)
    assert all(b.run_experts.__func__ in MOE_BACKENDS.values()
               for b in moe_blocks(plain.target.model))
    prompts = [q.text for q in load_prompts("spec_bench", limit=40)][::5][:8]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    assert ref[0] == plain.generate(prompts[:1], params)[0].token_ids
    for speculative in [{"method": "draft", "draft_model": DRAFT, "num_speculative_tokens": 4},
                        {"method": "ngram", "num_speculative_tokens": 3}]:
        spec = plain.with_speculative(speculative)
        assert spec.generate(prompts[:1], params)[0].token_ids == ref[0]
        assert [o.token_ids for o in spec.generate(prompts, params)] == ref


def test_moe_backend_from_configuration():
    """`moe_backend` reaches every MoE block; the grouped_mm backend keeps dense weights and
    gives the reference backend's greedy tokens."""
    from specmoe.layers.moe.backends import moe_blocks
    from specmoe.layers.moe.experts import RoutedExperts
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for backend in ["grouped_mm", "reference"]:
        llm = LLM(TARGET, dtype="float32", device="cpu", moe_backend=backend)
        method = getattr(RoutedExperts, f"forward_{backend}")
        for block in moe_blocks(llm.target.model):
            assert block.run_experts.__func__ is method and not block.experts.w13.is_meta
        outs[backend] = llm.generate(TEXTS[:2], params)
    assert [o.token_ids for o in outs["grouped_mm"]] == [o.token_ids for o in outs["reference"]]
