"""A MoE target that drafts for itself with fewer routed experts per token.

Mixtral, OLMoE, DeepSeek-V2-Lite and a carved MoE ship no small model of the same vocabulary,
and a second model costs memory a MoE does not have. The target's own weights can draft: with
K' < k routed experts per token (the router's top-K' of its k, their weights renormalised to
sum to 1) a draft forward reads about K'/k of the routed experts' bytes of a verification
window and needs no extra weights (self-speculative decoding with a cheaper pass of the
model itself, as LayerSkip, arXiv 2404.16710, and Draft & Verify, arXiv 2309.08168, do by
skipping layers; here the experts are skipped). Verification runs the target as it is, so
greedy outputs are those of plain decoding and sampled ones the target's distribution.

`SelfDraftProposer` is `DraftModelProposer` over the target's own runner: its drafts run
batched with a KV cache of their own (the draft's keys and values differ from the target's
once an expert is left out), caught up on each request's context as a draft model's is.
While it drafts, the routers keep K' experts and the decoder layers run as modules (the
fused driver's tables hold k).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from specmoe.config import KernelConfig
from specmoe.layers.moe.backends import moe_blocks
from specmoe.spec_decode.draft_model import DraftModelProposer
from specmoe.spec_decode.proposer import DraftProposal, ProposeRequest
from specmoe.worker.kernel_switches import KernelSwitches
from specmoe.worker.model_runner import ModelRunner


class SelfDraftProposer(DraftModelProposer):
    """Drafts with the target's own weights at `num_experts_per_tok` routed experts.

    Args:
        target: the target's runner (its model is shared, not copied).
        num_blocks: KV cache blocks of the drafts' own cache.
        block_size: token positions per block.
        num_experts_per_tok: K', 1 <= K' < the target's top-k.

    Raises:
        ValueError: a target without MoE layers, or K' out of range.
    """

    name = "self"

    def __init__(self, target: ModelRunner, num_blocks: int, block_size: int,
                 num_experts_per_tok: int, kv_cache_dtype: str = "auto") -> None:
        routers = [block.router for block in moe_blocks(target.model)]
        if not routers:
            raise ValueError("--draft self:experts=K needs a MoE target: this one has no "
                             "routed experts to leave out")
        top_k = min(r.top_k for r in routers)
        if not 1 <= num_experts_per_tok < top_k:
            raise ValueError(f"invalid self-draft experts={num_experts_per_tok}: must be "
                             f"1 to {top_k - 1} (the target routes each token to {top_k})")
        super().__init__(target, num_blocks, block_size, kv_cache_dtype)
        self.routers, self.num_experts_per_tok = routers, num_experts_per_tok
        self._modules_path = KernelSwitches(KernelConfig(fused_layers=False))

    def propose(self, reqs: list[ProposeRequest]) -> list[DraftProposal]:
        with self._fewer_experts():
            return super().propose(reqs)

    @contextlib.contextmanager
    def _fewer_experts(self) -> Iterator[None]:
        """The routers at K' experts with renormalised weights and the fused driver off
        (`worker.kernel_switches`), put back after (on error too)."""
        saved = [(r.top_k, r.norm_topk_prob) for r in self.routers]
        for router in self.routers:
            router.top_k, router.norm_topk_prob = self.num_experts_per_tok, True
        try:
            with self._modules_path:
                yield
        finally:
            for router, (top_k, norm) in zip(self.routers, saved):
                router.top_k, router.norm_topk_prob = top_k, norm
