"""A lower bound on the time of a throughput run: the roofline of each of its engine steps.

A step that puts `tokens` rows through the model does at least
2 (P_body tokens + P_head head_rows) flops of matmuls (P_body: the matmul weights one token
meets in the decoder layers, k of N experts in an MoE layer; P_head: the LM head) and reads
at least max(0, W - C) bytes of weights (W: the weights every forward reads, C: the
last-level cache, which may hold the rest between steps). Its time is then at least
max(flops / F, bytes / BW) (the roofline of Williams et al. 2009, "Roofline: an insightful
visual performance model", CACM 52(4)), with F the probed multiply-add peak of the
machine's vector unit (`specmoe.kernels.peak`) and BW the best probed read bandwidth.

Everything else is left out, so no implementation that schedules the same tokens can beat
the sum on that machine:
attention (its flops and KV reads), norms, sampling, the scheduler, a draft model's
forwards, and the LM head rows of steps that carry prompt tokens (the step records do not
say how many prompts end in them). `specmoe bench throughput` reports each run's fraction of
its floor and the scaling ratio a run at the floor would give, which says whether a target
ratio is within this machine's reach at all. Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specmoe.config import ArchConfig

BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class MatmulCounts:
    """Matmul parameters of a model, for its compute and weight-read floors.

    Attributes:
        body_params: weights one token's row is multiplied through in the decoder layers
            (attention projections, dense MLPs, and the router, shared expert and top_k routed
            experts of MoE layers).
        head_params: LM head weights.
        min_weight_bytes: bytes of weights any forward reads: every dense weight and the
            head, plus top_k routed experts per MoE layer (a forward whose tokens all share
            their experts), at `bytes_per_weight` (quantisation scales not counted).
    """

    body_params: int
    head_params: int
    min_weight_bytes: float

    @classmethod
    def from_arch(cls, arch: ArchConfig, bytes_per_weight: float) -> "MatmulCounts":
        """Counts from the architecture. Raises ValueError for bytes_per_weight <= 0."""
        if bytes_per_weight <= 0:
            raise ValueError(f"invalid bytes_per_weight={bytes_per_weight}: must be > 0")
        h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
        kv = arch.num_key_value_heads * arch.head_dim
        attn = h * (q + 2 * kv) + q * h
        moe = arch.moe
        moe_layers = set(moe.moe_layers) if moe is not None else set()
        body = 0
        for i in range(arch.num_hidden_layers):
            if i in moe_layers:
                shared = 3 * h * moe.shared_expert_intermediate_size
                shared += h if moe.has_shared_expert_gate else 0
                body += attn + h * moe.num_experts + shared \
                    + moe.top_k * 3 * h * moe.moe_intermediate_size
            else:
                body += attn + 3 * h * arch.intermediate_size
        head = arch.vocab_size * h
        return cls(body, head, (body + head) * bytes_per_weight)

    @property
    def flops_per_token(self) -> int:
        """Matmul flops of one decoded token (head included)."""
        return 2 * (self.body_params + self.head_params)


@dataclass(frozen=True)
class Machine:
    """What bounds a step on this machine.

    Attributes:
        peak_flops: multiply-add peak, flop/s.
        bandwidth: read bandwidth, bytes/s.
        cache_bytes: last-level cache (0: unknown, assumed to hold nothing).
        peak_source: how the peak was probed, in words.
    """

    peak_flops: float
    bandwidth: float
    cache_bytes: int = 0
    peak_source: str = ""

    def __post_init__(self) -> None:
        if not self.peak_flops > 0 or not self.bandwidth > 0 or self.cache_bytes < 0:
            raise ValueError(f"invalid machine: peak_flops={self.peak_flops}, bandwidth="
                             f"{self.bandwidth}, cache_bytes={self.cache_bytes}")

    def to_json(self) -> dict:
        return asdict(self)


def step_floor_seconds(counts: MatmulCounts, machine: Machine, num_tokens: int,
                       head_rows: int) -> float:
    """The least time of one forward of `num_tokens` rows, `head_rows` of them through the
    LM head: max(matmul flops / peak, uncached weight bytes / bandwidth)."""
    flops = 2.0 * (counts.body_params * num_tokens + counts.head_params * head_rows)
    weight_bytes = max(0.0, counts.min_weight_bytes - machine.cache_bytes)
    return max(flops / machine.peak_flops, weight_bytes / machine.bandwidth)


def run_floor_seconds(counts: MatmulCounts, machine: Machine,
                      steps: list[tuple[int, int]]) -> float:
    """The sum of `step_floor_seconds` over steps given as (num_tokens, head_rows)."""
    return sum(step_floor_seconds(counts, machine, t, h) for t, h in steps)
