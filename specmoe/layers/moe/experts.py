"""Routed SwiGLU experts: three implementations that read each active expert's weights once
per forward (one native call for the whole layer on CPU in bf16, a loop over active experts on
the native decode kernel, and a device-agnostic sort-then-grouped-matmul with no Python loop
and no host sync), and the plain per-token reference they are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.kernels import gemv, moe
from specmoe.kernels.gemv import PackedWeight
from specmoe.layers.linear import PackedWeights, linear
from specmoe.layers.mlp import silu_and_mul


# The fused MoE kernels take expert widths in multiples of this (AVX-512 bf16 lanes).
WIDTH_MULTIPLE = 16


class RoutedExperts(PackedWeights, nn.Module):
    """N SwiGLU experts with stacked weights.

    An expert width that is not a multiple of 16 (a carved checkpoint's 140, say) is stored
    zero-padded to the next one (I below): a padded neuron's gate and up rows and its down
    column are zero, so it adds exactly 0 and the outputs keep their bits, while the fused
    kernels (which need I % 16 == 0) take the layer instead of the per-expert loop. The
    weight loader fills the checkpoint's part and zeroes the rest.

    Parameters:
        w13: [N, 2 * I, H] gate (rows [0, I)) and up (rows [I, 2I)) projections.
        w2: [N, H, I] down projections.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        padded = -(-intermediate_size // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        self.num_experts = num_experts
        self.checkpoint_intermediate_size = intermediate_size
        self.intermediate_size = padded
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * padded, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, padded))
        # Read by the weight loader: leading expert dimension, gate/up row shards of w13,
        # the padding a checkpoint's smaller tensors leave (zeroed).
        self.w13.num_experts = self.w2.num_experts = num_experts
        self.w13.shard_sizes = [padded, padded]
        self.w13.pad_multiple = self.w2.pad_multiple = WIDTH_MULTIPLE
        self.w13_panels, self.w2_panels = PackedWeight(), PackedWeight()
        self.reads_packed = True  # False: a backend that needs the dense weights runs

    def subset(self, ids: list[int]) -> "RoutedExperts":
        """A copy holding only experts `ids` (expert i of the copy is `ids[i]`): one rank's
        share under expert parallelism. Call on the loaded dense weights, before packing.

        Raises:
            ValueError: an id outside [0, N), or the dense weights already released.
        """
        if self.w13.is_meta or not ids or not all(0 <= e < self.num_experts for e in ids):
            raise ValueError(f"cannot take experts {ids} of {self.num_experts} "
                             "(ids in range, dense weights not yet released for packing)")
        with torch.device("meta"):
            part = RoutedExperts(len(ids), self.w13.shape[-1], self.checkpoint_intermediate_size)
        index = torch.tensor(ids, device=self.w13.device)
        part.w13 = nn.Parameter(self.w13.detach().index_select(0, index), requires_grad=False)
        part.w2 = nn.Parameter(self.w2.detach().index_select(0, index), requires_grad=False)
        return part

    def packed_weights(self) -> list[tuple[PackedWeight, torch.Tensor]]:
        if not self.reads_packed:  # never packed, so never released
            return []
        return [(self.w13_panels, self.w13), (self.w2_panels, self.w2)]

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x [n, H] -> [n, H] (`linear`: the decode kernel for a few rows, on
        the experts' packed weights)."""
        h = linear(x, self.w13[e], packed=self._panels(self.w13_panels, self.w13, e, x))
        h = silu_and_mul(h)
        return linear(h, self.w2[e], packed=self._panels(self.w2_panels, self.w2, e, h))

    @staticmethod
    def _panels(cache: PackedWeight, weights: torch.Tensor, e: int, x: torch.Tensor
                ) -> torch.Tensor | None:
        """Expert e's packed weight where the kernel takes x or the weights were released
        (all experts packed at once)."""
        if weights.is_meta or gemv.applies(x, weights[e]):
            return cache.get(weights)[e]
        return None

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                ) -> torch.Tensor:
        """Grouped forward: sort (token, expert) pairs by expert, one matmul per active expert.

        x [T, H]; topk_ids [T, k] int64; topk_weights [T, k] (x's dtype). Returns [T, H].
        The per-expert counts are read on the host once per call (a fused GPU kernel would
        avoid this sync; the plain-torch path needs it to slice).
        """
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)                       # [T * k]
        order = torch.argsort(flat_ids, stable=True)          # pairs grouped by expert
        token_idx = order // top_k                            # [T * k]
        weights = topk_weights.reshape(-1)[order].unsqueeze(1)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = token_idx[start:start + n]
            y = self.expert_forward(e, x[idx]) * weights[start:start + n]
            out.index_add_(0, idx, y)
            start += n
        return out

    def forward_fused(self, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        """Fused forward: the whole layer in one native call (`specmoe.kernels.moe`) on the
        experts' packed weights: the pairs sorted by expert inside the kernel, each active
        expert's panels read once for all its rows, threads sharing the active experts'
        panels, the top-k weights applied in float32 and a token's k contributions summed in
        slot order, rounded once. No Python loop and no host sync; a token's output bits do
        not depend on the other tokens of the call. Where the kernel does not apply (another
        device or dtype, kernels off or not built, autograd) this is `forward`.

        x [T, H]; topk_ids [T, k] int64; topk_weights [T, k]. Returns [T, H] in x's dtype.
        Raises ValueError (from the kernel's checks) for an expert id outside [0, N).
        """
        out = moe.try_moe_bf16(x, topk_ids, topk_weights, self.w13, self.w2,
                               self.w13_panels, self.w2_panels)
        return self.forward(x, topk_ids, topk_weights) if out is None else out

    def forward_grouped_mm(self, x: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor) -> torch.Tensor:
        """Sorted grouped-matmul forward: the (token, slot) pairs sorted by expert, then one
        `torch.nn.functional.grouped_mm` for every expert's gate/up and one for its down
        projection (each active expert's weights read once, empty experts skipped by the
        offsets), as vLLM's and SGLang's torch-native MoE paths and Megablocks' grouped GEMM
        (Gale et al. 2022, arXiv 2211.15841) do. No Python loop over experts and no host
        synchronisation, so it suits CUDA and CPUs without the native kernels.

        x [T, H]; topk_ids [T, k] int64; topk_weights [T, k]. Returns [T, H] in x's dtype.
        The top-k weights are applied in float32 and a token's k contributions are summed in
        slot order. Raises RuntimeError if the dense weights were released (the native
        kernel's packed copies replace them; use `forward` then).
        """
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)                                   # [T * k]
        order = torch.argsort(flat_ids, stable=True)                      # pairs by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)                        # [N] group ends
        h = F.grouped_mm(x[order // top_k], self._dense(self.w13).transpose(1, 2), offs=offs)
        y = F.grouped_mm(silu_and_mul(h), self._dense(self.w2).transpose(1, 2), offs=offs)
        y = y.float() * topk_weights.reshape(-1)[order].float().unsqueeze(1)  # [T * k, H]
        pairs = torch.empty_like(y).index_copy_(0, order, y)              # back to (t, slot)
        return pairs.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)

    @staticmethod
    def _dense(weights: torch.Tensor) -> torch.Tensor:
        if weights.is_meta:
            raise RuntimeError("the experts' dense weights were released for the native "
                               "kernel; the grouped_mm MoE backend needs them")
        return weights

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
        """Plain per-token reference of `forward`: for each token, sum its k experts."""
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                e = int(topk_ids[t, j])
                out[t] += (self.expert_forward(e, x[t:t + 1]) * topk_weights[t, j])[0]
        return out
