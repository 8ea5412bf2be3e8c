"""Every supported model family against HuggingFace `transformers` on tiny random configs.

For each family a random model is built with `AutoModelForCausalLM.from_config`, saved with
`save_pretrained` and loaded with our loader in float32. We then check:
  (a) logits of one prefill and of the same tokens fed in chunks through the KV cache (decode,
      multi-token verification and SDPA-with-offset paths) equal transformers' within 1e-4,
      also after rolling the cache back and feeding different tokens;
  (b) the greedy continuation from `LLM.generate` equals `hf_model.generate(do_sample=False)`;
  (c) greedy speculative decoding (n-gram and draft model) emits exactly the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from specmoe import LLM, SamplingParams
from specmoe.config import ModelConfig
from specmoe.loader.model_loader import LoadedModel, load_model
from specmoe.worker.model_runner import ModelRunner, SequenceInput
from tiny_models import deepseek_config

VOCAB_SIZE = 160
SEQ_LEN = 24
NUM_NEW_TOKENS = 32
ATOL = 1e-4

_BASE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    # Larger than the default 0.02 so attention is peaked and routing decisive: a wrong mask,
    # RoPE or expert choice then moves the logits far beyond ATOL.
    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
_MOE = dict(num_experts=8, num_experts_per_tok=2)
_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32, rope_theta=10000.0)


def _config(case: str) -> transformers.PretrainedConfig:
    base = dict(_BASE)
    if case == "llama_tied_llama3_rope":
        return transformers.LlamaConfig(**base, tie_word_embeddings=True,
                                        rope_parameters=_LLAMA3_ROPE)
    if case == "llama_linear_rope":
        rope = dict(rope_type="linear", factor=2.0, rope_theta=5000.0)
        return transformers.LlamaConfig(**base, rope_parameters=rope)
    if case == "mistral_sliding_window":
        base["num_hidden_layers"] = 3
        return transformers.MistralConfig(**base, sliding_window=8)
    if case == "qwen2":
        return transformers.Qwen2Config(**base)
    if case == "qwen3":
        return transformers.Qwen3Config(**base, head_dim=24)
    if case == "mixtral":
        return transformers.MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2)
    if case == "qwen2_moe_sparse_step":
        base["num_hidden_layers"] = 3  # layer 1 is MoE, layers 0 and 2 dense
        return transformers.Qwen2MoeConfig(**base, **_MOE, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48,
                                           decoder_sparse_step=2)
    if case == "qwen2_moe_padded_experts":  # experts of 28, stored padded to 32
        return transformers.Qwen2MoeConfig(**base, **_MOE, moe_intermediate_size=28,
                                           shared_expert_intermediate_size=56)
    if case == "qwen3_moe_norm_topk":
        return transformers.Qwen3MoeConfig(**base, **_MOE, moe_intermediate_size=32,
                                           head_dim=24, norm_topk_prob=True)
    if case == "qwen3_moe_no_norm_topk_mlp_only":
        base["num_hidden_layers"] = 3  # layer 1 dense, layers 0 and 2 MoE
        return transformers.Qwen3MoeConfig(**base, **_MOE, moe_intermediate_size=32,
                                           head_dim=16, norm_topk_prob=False,
                                           mlp_only_layers=[1])
    if case == "olmoe":
        return transformers.OlmoeConfig(**base, **_MOE, clip_qkv=0.5)
    if case.startswith("deepseek"):
        return deepseek_config(case, **base)
    raise KeyError(case)


CASES = ["llama_tied_llama3_rope", "llama_linear_rope", "mistral_sliding_window", "qwen2",
         "qwen3", "mixtral", "qwen2_moe_sparse_step", "qwen2_moe_padded_experts",
         "qwen3_moe_norm_topk",
         "qwen3_moe_no_norm_topk_mlp_only", "olmoe", "deepseek_v2_lite",
         "deepseek_v2_group_limited", "deepseek_v3", "deepseek_v3_yarn_halves"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Family:
    case: str
    path: Path
    hf_model: transformers.PreTrainedModel
    loaded: LoadedModel
    runner: ModelRunner


def _randomise_vectors(model: torch.nn.Module) -> None:
    """Norm weights and biases start at 1 and 0, DeepSeek-V3's router score-correction bias
    (a buffer in transformers) at 0: perturb them so loading them is tested."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))


@pytest.fixture(scope="module", params=CASES)
def family(request, tmp_path_factory) -> Family:
    case = request.param
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        _config(case), dtype=torch.float32, attn_implementation="eager").eval()
    _randomise_vectors(hf_model)
    path = tmp_path_factory.mktemp(case)
    hf_model.save_pretrained(path)
    loaded = load_model(ModelConfig(str(path), dtype="float32", device="cpu"))
    return Family(case, path, hf_model, loaded, ModelRunner(loaded))


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [T, vocab_size]


def _random_ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (n,), generator=g).tolist()


def test_parsed_architecture(family: Family):
    cfg, arch = family.hf_model.config, family.loaded.arch
    assert arch.vocab_size == cfg.vocab_size
    assert arch.num_hidden_layers == cfg.num_hidden_layers
    assert arch.tie_word_embeddings == bool(cfg.tie_word_embeddings)
    hf_moe_layers = [i for i, layer in enumerate(family.hf_model.model.layers)
                     if hasattr(layer.mlp, "gate")]
    assert (arch.moe.moe_layers if arch.is_moe else []) == hf_moe_layers
    if family.case in ("qwen2_moe_sparse_step", "qwen3_moe_no_norm_topk_mlp_only") or \
            family.case.startswith("deepseek"):
        assert 0 < len(hf_moe_layers) < cfg.num_hidden_layers  # dense and MoE layers mixed


def test_prefill_logits_match(family: Family):
    ids = _random_ids(1, SEQ_LEN)
    cache = family.runner.new_cache(SEQ_LEN)
    ours = family.runner.forward(cache, ids)
    torch.testing.assert_close(ours, _hf_logits(family.hf_model, ids), atol=ATOL, rtol=0)
    assert cache.num_computed == SEQ_LEN


@pytest.mark.parametrize("chunks", [[10, 1, 5, 8], [5, 17, 1, 1]],
                         ids=["small_queries", "sdpa_with_offset"])
def test_chunked_logits_match(family: Family, chunks: list[int]):
    ids = _random_ids(1, SEQ_LEN)
    ref = _hf_logits(family.hf_model, ids)
    cache = family.runner.new_cache(SEQ_LEN)
    start = 0
    for n in chunks:
        ours = family.runner.forward(cache, ids[start:start + n])
        torch.testing.assert_close(ours, ref[start:start + n], atol=ATOL, rtol=0,
                                   msg=lambda m: f"chunk at {start}: {m}")
        start += n
    assert start == SEQ_LEN


def test_rollback_then_new_tokens_match(family: Family):
    """Rejected drafts: roll back, feed other tokens; stale cache entries must not leak."""
    ids = _random_ids(1, SEQ_LEN)
    keep = 15
    other = ids[:keep] + _random_ids(2, SEQ_LEN - keep)
    cache = family.runner.new_cache(SEQ_LEN)
    family.runner.forward(cache, ids[:12])
    family.runner.forward(cache, ids[12:])
    cache.rollback(keep)
    ours = family.runner.forward(cache, other[keep:keep + 4])
    ours = torch.cat([ours, family.runner.forward(cache, other[keep + 4:])])
    ref = _hf_logits(family.hf_model, other)[keep:]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def _shuffled_tables(lengths: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    """Disjoint block tables drawn from a shuffled pool, so no table is contiguous."""
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = []
    for n in lengths:
        num = -(-n // block_size)
        tables.append(pool[:num])
        del pool[:num]
    return tables


def test_batched_paged_forward_matches(family: Family):
    """Four sequences share one paged cache through shuffled block tables; each forward
    mixes a prefill chunk (fused SDPA), chunks with an offset, verification-sized windows and
    single-token decodes. Every logit row matches transformers run on that sequence alone."""
    block_size, lengths = 4, [SEQ_LEN, 9, 20, 3]
    seqs = [_random_ids(10 + i, n) for i, n in enumerate(lengths)]
    refs = [_hf_logits(family.hf_model, s) for s in seqs]
    tables = _shuffled_tables(lengths, block_size, num_blocks=40)
    cache = family.runner.new_paged_cache(num_blocks=40, block_size=block_size)
    starts = [0] * len(seqs)
    for chunk in ([20, 5, 17, 1], [3, 4, 1, 2], [1, 0, 2, 0]):
        batch = [(i, n) for i, n in enumerate(chunk) if n]
        inputs = [SequenceInput(seqs[i][starts[i]:starts[i] + n], starts[i], tables[i], n)
                  for i, n in batch]
        logits = family.runner.execute(cache, inputs).split([n for _, n in batch])
        for (i, n), ours in zip(batch, logits):
            torch.testing.assert_close(ours, refs[i][starts[i]:starts[i] + n], atol=ATOL,
                                       rtol=0, msg=lambda m: f"sequence {i}: {m}")
            starts[i] += n
    assert starts == lengths


def _prompt() -> list[int]:
    half = _random_ids(3, 6)
    return half + _random_ids(4, 2) + half  # repeated so the n-gram proposer finds matches


@pytest.fixture(scope="module")
def hf_greedy(family: Family) -> list[int]:
    # We generate with ignore_eos=True; transformers must not stop at EOS either (a None in a
    # generation_config passed to generate() would be filled back in from the model's).
    family.hf_model.generation_config.eos_token_id = None
    prompt = _prompt()
    with torch.no_grad():
        out = family.hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=NUM_NEW_TOKENS)
    new = out[0, len(prompt):].tolist()
    assert len(new) == NUM_NEW_TOKENS  # transformers did not stop early
    return new


def _generate(family: Family, speculative: dict | None):
    llm = LLM(str(family.path), speculative=speculative, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    (out,) = llm.generate([_prompt()], params)
    return out


def test_greedy_matches_transformers(family: Family, hf_greedy: list[int]):
    out = _generate(family, None)
    assert out.token_ids == hf_greedy
    assert out.finish_reason == "length"
    assert out.spec_stats.num_drafts == 0


def test_greedy_ngram_speculation_is_lossless(family: Family, hf_greedy: list[int]):
    out = _generate(family, {"method": "ngram", "num_speculative_tokens": 4})
    assert out.token_ids == hf_greedy
    assert out.spec_stats.num_accepted_tokens > 0  # multi-token verification was exercised


def test_greedy_draft_model_speculation_is_lossless(family: Family, hf_greedy: list[int]):
    out = _generate(family, {"method": "draft", "draft_model": str(family.path),
                             "num_speculative_tokens": 3})
    assert out.token_ids == hf_greedy
    stats = out.spec_stats
    assert stats.num_draft_tokens > 0
    # The draft is the target itself, so (up to fp32 near-ties) every draft is accepted.
    assert stats.acceptance_rate > 0.9, stats.to_dict()


def test_qwen3_dense_drafts_for_a_qwen3_moe_target(tmp_path):
    """The pairing users run: a Qwen3 dense draft (same vocabulary) for a Qwen3-MoE target;
    greedy output with it equals the target's plain greedy output."""
    paths = {}
    for case in ("qwen3_moe_norm_topk", "qwen3"):
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(_config(case)).eval()
        paths[case] = tmp_path / case
        model.save_pretrained(paths[case])
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    plain = LLM(str(paths["qwen3_moe_norm_topk"]), dtype="float32")
    spec = plain.with_speculative({"method": "draft", "draft_model": str(paths["qwen3"]),
                                   "num_speculative_tokens": 3})
    (want,), (got,) = plain.generate([_prompt()], params), spec.generate([_prompt()], params)
    assert got.token_ids == want.token_ids and got.spec_stats.num_draft_tokens > 0
