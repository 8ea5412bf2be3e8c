"""A lower bound on the time of a throughput run: its matmul flops at the machine's peak.

A step that puts `tokens` rows through the model does at least
2 (P_body tokens + P_head logit_rows) flops of matmuls (P_body: the matmul weights one token
meets in the decoder layers, k of N experts in an MoE layer; P_head: the LM head;
logit_rows: the rows the step computes logits for). At a multiply rate of at most F flop/s
it takes at least that / F (the compute roof of Williams et al. 2009, "Roofline: an
insightful visual performance model", CACM 52(4)). F is the best rate probed on the machine
(`specmoe.bench.roofline.measure_peak_flops`): the vector unit's multiply-add peak and large
`torch.matmul` calls, whichever is higher.

Everything else is left out: attention, norms, sampling, the scheduler, a draft model's
forwards, and the time to read weights and KV from memory. So an engine that schedules the
same tokens can only beat the floor by multiplying faster than F. `specmoe bench throughput`
reports each run's floor as a fraction of its wall time, and the scaling ratio the target
concurrency would reach at its floor against C=1 as measured: a cap on what any engine could
show against that C=1 on this machine. Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from specmoe.config import ArchConfig


@dataclass(frozen=True)
class MatmulCounts:
    """Matmul weights a token's row is multiplied through.

    Attributes:
        body_params: in the decoder layers: attention projections, dense MLPs, and the
            router, shared expert (and its gate) and top_k routed experts of MoE layers (the
            active non-embedding parameters, norms left out).
        head_params: the LM head (vocab_size x hidden_size).
    """

    body_params: int
    head_params: int

    @classmethod
    def from_arch(cls, arch: ArchConfig) -> "MatmulCounts":
        """Counts from the architecture."""
        h, moe = arch.hidden_size, arch.moe
        moe_layers = set(moe.moe_layers) if moe is not None else set()
        body = 0
        for i in range(arch.num_hidden_layers):
            if i in moe_layers:
                shared = arch.gated_mlp_params(moe.shared_expert_intermediate_size)
                shared += h if moe.has_shared_expert_gate else 0
                body += arch.attention_params + h * moe.num_experts + shared \
                    + moe.top_k * arch.gated_mlp_params(moe.moe_intermediate_size)
            else:
                body += arch.attention_params + arch.gated_mlp_params(arch.intermediate_size)
        return cls(body, arch.vocab_size * h)

    def step_flops(self, num_tokens: int, logit_rows: int) -> float:
        """Matmul flops of a forward of num_tokens rows, logit_rows of them through the head."""
        return 2.0 * (self.body_params * num_tokens + self.head_params * logit_rows)


def run_floor_seconds(counts: MatmulCounts, peak_flops: float,
                      steps: list[tuple[int, int]]) -> float:
    """Seconds the steps' matmuls take at peak_flops flop/s at least; steps are given as
    (num_tokens, logit_rows). Raises ValueError for peak_flops <= 0."""
    if not peak_flops > 0:
        raise ValueError(f"invalid peak_flops={peak_flops}: must be > 0")
    return sum(counts.step_flops(t, h) for t, h in steps) / peak_flops
