"""Building the proposer a SpeculativeConfig asks for."""

from __future__ import annotations

from specmoe.config import ModelConfig, SpeculativeConfig
from specmoe.loader.model_loader import load_model
from specmoe.spec_decode.draft_model import DraftModelProposer
from specmoe.spec_decode.ngram import NgramProposer
from specmoe.worker.model_runner import ModelRunner


def build_proposer(spec: SpeculativeConfig, target: ModelRunner, target_tokenizer,
                   target_model_config: ModelConfig, num_kv_blocks: int, block_size: int):
    """An NgramProposer or a DraftModelProposer (draft loaded with the target's dtype and
    device, with a KV cache of `num_kv_blocks` blocks of `block_size` positions; it stops
    drafting at its own context limit).

    Raises:
        ValueError: when the draft model's vocabulary differs from the target's.
    """
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    draft = load_model(ModelConfig(spec.draft_model, dtype=target_model_config.dtype,
                                   device=str(target.device),
                                   quantization=spec.draft_quantization,
                                   moe_backend=target_model_config.moe_backend))
    check_vocab_match(target, target_tokenizer, draft)
    return DraftModelProposer(ModelRunner(draft), num_kv_blocks, block_size)


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
