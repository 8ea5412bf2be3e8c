"""Building the proposer and the speculation policy a SpeculativeConfig asks for."""

from __future__ import annotations

from specmoe.config import ModelConfig, SpeculativeConfig, parse_batch_size_table
from specmoe.loader.model_loader import load_model
from specmoe.spec_decode.adaptive import AdaptivePolicy, AdaptiveSettings
from specmoe.spec_decode.draft_model import DraftModelProposer
from specmoe.spec_decode.ngram import NgramProposer
from specmoe.spec_decode.policy import (BatchSizeTablePolicy, NoSpeculation, SpeculationPolicy,
                                        StaticPolicy)
from specmoe.spec_decode.self_draft import SelfDraftProposer
from specmoe.spec_decode.shadow import SHADOW_EVERY
from specmoe.worker.model_runner import ModelRunner


def build_policy(spec: SpeculativeConfig | None, target: ModelRunner,
                 proposer) -> SpeculationPolicy:
    """The policy `spec.policy` names, for `target` and `proposer`: `NoSpeculation` without
    a config; the adaptive policy is told the target's routed experts when it is a MoE
    (every MoE layer alike: the step-time model's expert term is per layer) and shadows
    prompt lookup's proposals.

    Raises:
        ValueError: from `AdaptivePolicy` (shadows of a proposer that keeps state).
    """
    limit = target.max_model_len
    if spec is None:
        return NoSpeculation(limit)
    k, pause = spec.num_speculative_tokens, spec.disable_by_batch_size
    if spec.policy == "batch_size_table":
        return BatchSizeTablePolicy(limit, k, parse_batch_size_table(spec.batch_size_table),
                                    pause)
    if spec.policy != "adaptive":
        return StaticPolicy(limit, k, pause)
    moe = target.arch.moe
    n, top_k = (moe.num_experts, moe.top_k) if moe is not None and moe.moe_layers else (0, 0)
    settings = AdaptiveSettings(max_k=k, num_experts=n, top_k=top_k,
                                match_trim=spec.match_trim,
                                shadow_every=SHADOW_EVERY if spec.method == "ngram" else 0)
    return AdaptivePolicy(settings, limit, proposer, target.model, pause)


def build_proposer(spec: SpeculativeConfig, target: ModelRunner, target_tokenizer,
                   target_model_config: ModelConfig, num_kv_blocks: int, block_size: int,
                   loaded_drafts: dict | None = None, kv_cache_dtype: str = "auto"):
    """An NgramProposer, a SelfDraftProposer over the target, or a DraftModelProposer (draft
    loaded with the target's dtype and device); the latter two with a KV cache of their own of
    `num_kv_blocks` blocks of `block_size` positions in `kv_cache_dtype` (the target's: a
    draft stops at its context limit).

    `loaded_drafts` ({(draft_model, draft_quantization): ModelRunner}), when given, is
    consulted before loading and filled after: proposers of engines that never run at the
    same time share one copy of the draft's weights (each keeps its own KV cache).

    Raises:
        ValueError: the draft model's vocabulary differs from the target's, or a self-draft
            of a dense target or with too many experts (`SelfDraftProposer`).
    """
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "self":
        return SelfDraftProposer(target, num_kv_blocks, block_size, spec.self_draft_experts,
                                 kv_cache_dtype)
    key = (spec.draft_model, spec.draft_quantization)
    runner = (loaded_drafts or {}).get(key)
    if runner is None:
        draft = load_model(ModelConfig(spec.draft_model, dtype=target_model_config.dtype,
                                       device=str(target.device),
                                       quantization=spec.draft_quantization,
                                       moe_backend=target_model_config.moe_backend))
        check_vocab_match(target, target_tokenizer, draft)
        runner = ModelRunner(draft)
        if loaded_drafts is not None:
            loaded_drafts[key] = runner
    return DraftModelProposer(runner, num_kv_blocks, block_size, kv_cache_dtype)


def check_vocab_match(target: ModelRunner, target_tokenizer, draft) -> None:
    """Raise ValueError unless the draft's vocabulary equals the target's."""
    if draft.arch.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {draft.path} has vocab_size={draft.arch.vocab_size} "
                         f"but the target has {target.vocab_size}: speculative decoding "
                         "needs the same vocabulary")
    if target_tokenizer is None:
        return
    draft_tokenizer = draft.load_tokenizer()
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"draft model {draft.path} has a different tokenizer vocabulary "
                         "from the target's: speculative decoding needs the same vocabulary")
