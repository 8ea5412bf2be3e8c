"""Layers whose weights stay GGUF blocks at the file's own type (`quantization="gguf"`):
projections, the token embedding and a MoE block's routed experts, each computing with
exactly the values the file's blocks decode to (`specmoe.kernels.gguf_gemm`), so the model
holds about the file's bytes instead of a full-precision copy and reads those bytes per
token, as llama.cpp does.

Blocks are buffers (they move with the module and into huge pages); a layer builds its
`GGUFWeight` views from them at each call. Activations are rounded to int8 per block and
multiplied in integers by the kernel (`specmoe.kernels.gguf_gemm` gives the rounding), the
results rounded to the activations' dtype; the plain-torch references
(`forward_reference`) round the activations the same way and multiply them by the `gguf`
package's dequantisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.kernels.gguf_gemm import (
    GGUFWeight,
    activation_block,
    dequantize_reference,
    quantize_activations,
    try_moe,
)


class GGUFParts(nn.Module):
    """Row shards of one weight [sum n_i, k], each GGUF blocks (`GGUFWeight`) or a dense
    float tensor [n_i, k] (a shard the file stores unquantised or at a type without a
    kernel). Buffers: `part{i}`."""

    def __init__(self, parts: list[GGUFWeight | torch.Tensor]) -> None:
        super().__init__()
        self.types: list[int | None] = []
        for i, part in enumerate(parts):
            is_blocks = isinstance(part, GGUFWeight)
            self.register_buffer(f"part{i}", part.blocks if is_blocks else part)
            self.types.append(int(part.ggml_type) if is_blocks else None)
        self.in_features = parts[0].in_features if isinstance(parts[0], GGUFWeight) \
            else parts[0].shape[1]
        self.sizes = [p.out_features if isinstance(p, GGUFWeight) else p.shape[0]
                      for p in parts]

    def parts(self) -> list[GGUFWeight | torch.Tensor]:
        return [getattr(self, f"part{i}") if t is None
                else GGUFWeight(t, getattr(self, f"part{i}"), self.in_features)
                for i, t in enumerate(self.types)]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, k] -> float32 [T, sum n_i]: one kernel call per shard into its columns."""
        xf = x.to(torch.float32).contiguous()
        out = torch.empty(xf.shape[0], sum(self.sizes), dtype=torch.float32, device=x.device)
        start = 0
        for part, n in zip(self.parts(), self.sizes):
            cols = out[:, start:start + n]
            if isinstance(part, torch.Tensor):
                cols.copy_(F.linear(xf, part.float()))
            elif not part.matmul_into(xf, cols):
                cols.copy_(part.matmul_reference(xf))
            start += n
        return out

    def matmul_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch of `matmul`: each shard's `GGUFWeight.matmul_reference` (x rounded as
        the kernel rounds it, the `gguf` package's values) or F.linear on a dense one."""
        xf = x.to(torch.float32)
        return torch.cat([F.linear(xf, p.float()) if isinstance(p, torch.Tensor)
                          else p.matmul_reference(xf) for p in self.parts()], dim=1)


class GGUFLinear(nn.Module):
    """y = x @ W^T (+ b) with W's shards in `GGUFParts` (q/k/v or gate/up keep one shard
    per checkpoint tensor, each at its own type); x [T, k] -> [T, n] in x's dtype.
    `weight_source` shares another module's parts (an LM head tied to a GGUF embedding)."""

    def __init__(self, parts: list[GGUFWeight | torch.Tensor] | None,
                 bias: torch.Tensor | None, weight_source: GGUFParts | None = None) -> None:
        super().__init__()
        if weight_source is None:
            self.weight_parts = GGUFParts(parts)
            self._tied: list[GGUFParts] = []
        else:
            self._tied = [weight_source]  # a list: not registered as this module's child
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def parts(self) -> GGUFParts:
        return self._tied[0] if self._tied else self.weight_parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parts.matmul(x)
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parts.matmul_reference(x)
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.parts.in_features}, out={self.parts.sizes}, types={self.parts.types}"


class GGUFEmbedding(nn.Module):
    """Token ids [T] int64 -> embeddings [T, H] in `dtype`, rows decoded from the blocks."""

    def __init__(self, weight: GGUFWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_parts = GGUFParts([weight])
        self.dtype = dtype

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        (weight,) = self.weight_parts.parts()
        return weight.rows(token_ids.reshape(-1)).reshape(*token_ids.shape, -1).to(self.dtype)


class GGUFRoutedExperts(nn.Module):
    """N SwiGLU experts (`RoutedExperts`' math) whose gate, up and down projections are
    stacked GGUF tensors as the file holds them (`ffn_gate_exps` [N, I, H],
    `ffn_up_exps` [N, I, H], `ffn_down_exps` [N, H, I]), each at its own type; gate and up
    of one type are joined into one stack [N, 2I, H] (one kernel call per expert).

    Forward: the (token, slot) pairs grouped by expert, then per active expert its rows
    through the block kernel for gate and up (the expert's blocks read once for all its
    rows), SiLU(gate) * up in float32, the kernel for down, each row weighted by its top-k
    weight in float32 and added to its token in ascending expert order (a token's sum
    depends on its own experts only), rounded once to x's dtype: the whole layer in one
    kernel call (`gguf_gemm.try_moe`), or `forward_loop` in Python. Every backend name runs
    this (`set_moe_backend`); `forward_reference` is the per-token plain-torch oracle.
    """

    def __init__(self, gate: GGUFWeight, up: GGUFWeight, down: GGUFWeight) -> None:
        super().__init__()
        if gate.ggml_type == up.ggml_type:
            gate_up = [GGUFWeight(gate.ggml_type, torch.cat([gate.blocks, up.blocks], dim=1),
                                  gate.in_features)]
        else:
            gate_up = [gate, up]
        self.gate_up = nn.ModuleList(GGUFParts([w]) for w in gate_up)
        self.down = GGUFParts([down])
        self.num_experts = gate.blocks.shape[0]
        self.intermediate_size = gate.out_features
        self.reads_packed = True  # set by `set_moe_backend`, as on `RoutedExperts`

    def _weights(self) -> tuple[list[GGUFWeight], GGUFWeight]:
        return [p.parts()[0] for p in self.gate_up], self.down.parts()[0]

    def weight_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x [n, H] -> float32 [n, H]."""
        gate_up, down = self._weights()
        h = torch.cat([w.expert(e).matmul(x) for w in gate_up], dim=1)
        return down.expert(e).matmul(F.silu(h[:, :self.intermediate_size])
                                     * h[:, self.intermediate_size:])

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H]; topk_ids [T, k] int64; topk_weights [T, k]. Returns [T, H] in x's dtype:
        one kernel call for the layer (`gguf_gemm.try_moe`) where gate and up share a type
        and the kernel runs, else `forward_loop`.

        Raises:
            IndexError: an expert id outside [0, N).
        """
        gate_up, down = self._weights()
        if len(gate_up) == 1 and x.shape[0]:
            out = try_moe(x, topk_ids, topk_weights, gate_up[0], down)
            if out is not None:
                return out.to(x.dtype)
        return self.forward_loop(x, topk_ids, topk_weights)

    def forward_loop(self, x: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
        """`forward` as a loop over the active experts (the block kernel per projection,
        SiLU in torch): the same sums as the one call up to SiLU's rounding."""
        flat = topk_ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_experts):
            raise IndexError(f"expert ids must lie in [0, {self.num_experts})")
        order = torch.argsort(flat, stable=True)
        tokens = order // topk_ids.shape[1]
        weights = topk_weights.reshape(-1)[order].float().unsqueeze(1)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = tokens[start:start + n]
                out.index_add_(0, idx, self.expert_forward(e, x[idx]) * weights[start:start + n])
                start += n
        return out.to(x.dtype)

    forward_fused = forward_grouped_mm = forward

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
        """Per token, its experts in ascending id order, each from the `gguf` package's
        dequantisation: the oracle of `forward`."""
        gate_up, down = self._weights()
        stacks = [(activation_block(w.ggml_type), dequantize_reference(w)) for w in gate_up]
        down_block, down_stack = activation_block(down.ggml_type), dequantize_reference(down)
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for j in torch.argsort(topk_ids[t], stable=True).tolist():
                e = int(topk_ids[t, j])
                h = torch.cat([F.linear(quantize_activations(x[t:t + 1], block), w[e])
                               for block, w in stacks], dim=1)
                h = F.silu(h[:, :self.intermediate_size]) * h[:, self.intermediate_size:]
                y = F.linear(quantize_activations(h, down_block), down_stack[e])
                out[t] += y[0] * topk_weights[t, j].float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        types = [p.types[0] for p in (*self.gate_up, self.down)]
        return f"num_experts={self.num_experts}, intermediate={self.intermediate_size}, types={types}"
