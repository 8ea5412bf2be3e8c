"""Predicting Tt(B, T), the verification forward time, from shapes, routing and this machine.

A matmul of m rows through P weights of s bytes streams its weights from memory; its time is
P s tau(m), where tau(m) is this machine's measured time per weight byte at m rows
(`MachineProfile.measure`, in the same run): the roofline of Williams et al. 2009 ("Roofline:
an insightful visual performance model", CACM 52(4)), max(1/BW, 2m/(s F)) at best, measured
rather than assumed. A forward of B requests with T tokens each (M = B T rows) sums, per layer:

- attention projections: an M-row matmul through the QKV and output weights;
- attention over the KV cache: B (context + T) KV bytes per layer read at the decode bandwidth;
- dense MLP: an M-row matmul; or an MoE layer: the router, plus U(B, T) experts each with
  m = M k / U rows, where U is the expected number of distinct experts the step's tokens
  route to (the union a grouped forward reads; `routing_gen.expected_unique_experts`);
- the LM head over all M rows.

The matmul time splits at the probe's one-row time per byte tau(1): a memory part P s tau(1)
(the weights streamed once) and a compute part P s (tau(m) - tau(1)), the time the rows add.
They get separate coefficients because a model's layers stream their weights at a bandwidth
the probe's pieces do not quite reach, while its compute-bound matmuls run at about the
probe's rate. A per-row term (L M) prices the work outside the matmuls that every row does:
norms, activations, RoPE, attention's queries, the logits' copy.

These terms, the KV reads, a fixed per-forward overhead and a per-expert-call overhead get
non-negative coefficients fitted by relative least squares (`CostModel.fit`) on the T = 1
and T = 2 columns (`FIT_TOKENS`), so every T >= 3 point (a verification of K >= 2 drafts) is
predicted, not fitted. T = 1 alone cannot tell per-request work (the KV term) from per-row
work: at T = 1 both grow as B. A fit on it alone put the per-row work of the real
Qwen2.5-Coder models on the KV term, which hardly grows with T, and underpredicted Tt(32, 9)
by 38%; the T = 2 column separates the two.

For contrast, the Amdahl-style estimate of the source analysis (DESIGN.md): the routed experts
are the only part of Tt(B, 1) that grows with T, in proportion to the unique experts, and
their share f of the time is their share of the bytes read:
Tt(B, T) ~= Tt(B, 1) ((1 - f) + f U(B, T) / U(B, 1)). For a dense model it predicts that
verification is free (ratio 1).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from specmoe.analysis.presets import Preset
from specmoe.bench.roofline import measure_read_bandwidth, synchronize
from specmoe.kernels.gemv import PackedWeight
from specmoe.layers.linear import linear

PROBE_ROWS = [1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
              768, 1024]
FEATURES = ["matmul_memory", "matmul_compute", "rows", "kv", "fixed", "expert_call"]
# The tokens per request of the grid points the coefficients are fitted on.
FIT_TOKENS = (1, 2)
# The error scope of the grid points outside the fit.
PREDICTED = f"predicted (T>={max(FIT_TOKENS) + 1})"


@dataclass
class MachineProfile:
    """This machine's measured matmul roofline: the time per weight byte of an m-row matmul
    whose weights stream from memory, for m in `probe_rows`.

    Roofline (Williams et al. 2009) says that time is max(1/BW, 2m / (s F)) per byte for
    read bandwidth BW, s bytes per weight and matmul throughput F; measuring it directly,
    through the engine's own `linear` (its decode kernel included), also captures how the two
    limits overlap at the rows where they meet.

    Attributes:
        bandwidth: bytes/s of one-row `linear` calls over weights far larger than the
            last-level cache (the decode read bandwidth).
        stream_bandwidth: bytes/s of a plain tensor sum over a large buffer, for reference.
        probe_rows: the row counts m probed, ascending.
        seconds_per_byte: seconds per weight byte of an m-row `linear` at each m, after
            `roofline_envelope`.
        dtype_bytes: bytes per weight of the probe.
        probed_seconds_per_byte: the probe's own minima before the envelope (None where the
            profile was not measured, e.g. built by hand).
    """

    bandwidth: float
    stream_bandwidth: float
    probe_rows: list[int]
    seconds_per_byte: list[float]
    dtype_bytes: int = 2
    probed_seconds_per_byte: list[float] | None = None

    @classmethod
    def measure(cls, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                probe_bytes: int = 512 << 20) -> "MachineProfile":
        """Probe with `probe_bytes` of [*, 2048] weights in 64 MiB pieces (about half a
        minute): every row count once per round, `repeats` rounds, the minimum per count, so
        a phase of slow memory in the middle of the probe slows every row count alike."""
        stream = measure_read_bandwidth(probe_bytes, device=device)
        pieces = _weight_pieces(probe_bytes, dtype, device)
        total = sum(w.numel() * w.element_size() for w in pieces)
        probed = [s / total for s in _probe_rows(pieces, PROBE_ROWS)]
        per_byte = roofline_envelope(PROBE_ROWS, probed)
        return cls(1.0 / per_byte[0], stream, list(PROBE_ROWS), per_byte, dtype.itemsize,
                   probed)

    @classmethod
    def from_json(cls, data: dict) -> "MachineProfile":
        """The profile `to_json` wrote (its derived `flops` dropped), under the roofline
        envelope (a no-op on profiles `measure` made; profiles saved before it existed get
        it too)."""
        fields = {k: v for k, v in data.items() if k != "flops"}
        fields["seconds_per_byte"] = roofline_envelope(fields["probe_rows"],
                                                       fields["seconds_per_byte"])
        return cls(**fields)

    def matmul_seconds(self, rows: float, num_params: float) -> float:
        """Seconds of an m-row matmul through num_params weights: the probed time per byte,
        interpolated linearly in m, extrapolated in proportion to m past the last probe."""
        if rows <= 0:
            return 0.0
        last = self.probe_rows[-1]
        if rows > last:
            per_byte = self.seconds_per_byte[-1] * rows / last
        else:
            per_byte = float(np.interp(rows, self.probe_rows, self.seconds_per_byte))
        return per_byte * num_params * self.dtype_bytes

    def memory_seconds(self, rows: float, num_params: float) -> float:
        """The part of `matmul_seconds` that streams the weights once: the one-row time per
        byte, for any rows > 0."""
        return self.seconds_per_byte[0] * num_params * self.dtype_bytes if rows > 0 else 0.0

    @property
    def flops(self) -> list[float]:
        """The probe's matmul throughput at each m, flop/s."""
        return [2.0 * m / (self.dtype_bytes * t)
                for m, t in zip(self.probe_rows, self.seconds_per_byte)]

    def to_json(self) -> dict:
        return {**asdict(self), "flops": self.flops}


def _weight_pieces(num_bytes: int, dtype: torch.dtype, device: str,
                   piece_bytes: int = 64 << 20) -> list[torch.Tensor]:
    rows = piece_bytes // (2048 * dtype.itemsize)
    return [torch.full((rows, 2048), 0.01, dtype=dtype, device=device)
            for _ in range(max(1, num_bytes // piece_bytes))]


def _time_rows(pieces: list[torch.Tensor], rows: int, repeats: int = 2) -> float:
    """Best-of-`repeats` seconds of an m-row `linear` through every piece, on the pieces'
    packed copies where the native kernel reads packed weights (as a loaded model's layers
    do: without them `linear` would repack every piece at every call and time that)."""
    x = torch.ones(rows, pieces[0].shape[1], dtype=pieces[0].dtype, device=pieces[0].device)
    packed = [PackedWeight() for _ in pieces]
    for w, cache in zip(pieces, packed):
        linear(x[:1], w, packed=cache)  # packs once, outside the timing
    best = float("inf")
    for _ in range(repeats):
        synchronize(x.device)
        start = time.perf_counter()
        for w, cache in zip(pieces, packed):
            linear(x, w, packed=cache)
        synchronize(x.device)
        best = min(best, time.perf_counter() - start)
    return best


def _probe_rows(pieces: list[torch.Tensor], rows: list[int], repeats: int = 3) -> list[float]:
    """Best-of-`repeats` seconds of `_time_rows` for each row count, interleaved by round."""
    best = [float("inf")] * len(rows)
    for _ in range(repeats):
        for i, m in enumerate(rows):
            best[i] = min(best[i], _time_rows(pieces, m, repeats=1))
    return best


def roofline_envelope(rows: list[int], seconds_per_byte: list[float]) -> list[float]:
    """Cap each probed time per byte at what fewer rows imply: m rows cost at most m / m'
    times the time of m' < m rows (the m rows could run as m / m' calls of m' rows). A probe
    that lands in a slow phase of memory reads above that cap and would otherwise bend the
    interpolated roofline at exactly that row count (one run measured 16 rows 1.6x slower
    per byte than 17, and the cost model fitted on it mispredicted Tt(16, T) by 35%).

    rows: ascending row counts; seconds_per_byte: the probe's time per byte at each.
    """
    out = list(seconds_per_byte)
    for i in range(1, len(out)):
        out[i] = min([out[i]] + [out[j] * rows[i] / rows[j] for j in range(i)])
    return out


@dataclass(frozen=True)
class ShapeCounts:
    """Per-layer parameter counts of a model, read from its preset or architecture.

    Attributes:
        num_layers: L.
        attn_params: QKV + output projection weights per layer (MLA: its q, kv_a, kv_b and
            o projections).
        mlp_params: the weights every token runs per layer besides attention: the dense MLP,
            or an MoE layer's shared expert and its gate (0 for an MoE without one).
        expert_params: one routed expert's weights (0 for dense).
        router_params: router weights per layer (0 for dense).
        head_params: LM head weights.
        kv_bytes_per_token: bytes one token stores per layer (key + value, or MLA's latent).
        num_experts, top_k: N and k (0 for dense).
        dtype_bytes: bytes per weight.
        num_dense_layers: layers of an MoE model with a dense MLP instead of the MoE block
            (DeepSeek's dense first layers; 0 for a dense model, whose every layer runs
            `mlp_params`).
        dense_mlp_params: the dense MLP weights of each of those layers.
    """

    num_layers: int
    attn_params: int
    mlp_params: int
    expert_params: int
    router_params: int
    head_params: int
    kv_bytes_per_token: int
    num_experts: int
    top_k: int
    dtype_bytes: int
    num_dense_layers: int = 0
    dense_mlp_params: int = 0

    @property
    def num_moe_layers(self) -> int:
        """Layers with an MoE block (0 for dense)."""
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @classmethod
    def from_preset(cls, preset: Preset, dtype_bytes: int = 2) -> "ShapeCounts":
        a = preset.arch()
        h = a.hidden_size
        if not preset.is_moe:
            return cls(a.num_hidden_layers, a.attention_params,
                       a.gated_mlp_params(preset.intermediate_size), 0, 0, a.vocab_size * h,
                       a.kv_cache_values_per_token * dtype_bytes, 0, 0, dtype_bytes)
        return cls(a.num_hidden_layers, a.attention_params,
                   a.gated_mlp_params(a.moe.shared_expert_intermediate_size),
                   a.gated_mlp_params(preset.intermediate_size), h * preset.num_experts,
                   a.vocab_size * h, a.kv_cache_values_per_token * dtype_bytes,
                   preset.num_experts, preset.top_k, dtype_bytes,
                   preset.first_dense_layers, a.gated_mlp_params(preset.dense_width))

    @classmethod
    def from_arch(cls, arch, dtype_bytes: int = 2) -> "ShapeCounts":
        """From a loaded model's `ArchConfig`: every layer dense, or MoE blocks in some
        layers and a dense MLP of `intermediate_size` in the others."""
        h, kv_values = arch.hidden_size, arch.kv_cache_values_per_token
        head = arch.vocab_size * h
        moe = arch.moe
        if moe is None or not moe.moe_layers:
            return cls(arch.num_hidden_layers, arch.attention_params,
                       arch.gated_mlp_params(arch.intermediate_size), 0, 0, head,
                       kv_values * dtype_bytes, 0, 0, dtype_bytes)
        shared = moe.shared_expert_intermediate_size
        shared_params = arch.gated_mlp_params(shared) + h if shared else 0
        num_dense = arch.num_hidden_layers - len(moe.moe_layers)
        return cls(arch.num_hidden_layers, arch.attention_params, shared_params,
                   arch.gated_mlp_params(moe.moe_intermediate_size), h * moe.num_experts,
                   head, kv_values * dtype_bytes, moe.num_experts, moe.top_k, dtype_bytes,
                   num_dense, arch.gated_mlp_params(arch.intermediate_size) if num_dense else 0)


def features(shape: ShapeCounts, machine: MachineProfile, batch_size: int, num_tokens: int,
             context_len: int, unique_experts: float) -> np.ndarray:
    """The cost model's terms for one (B, T), in the order of FEATURES: [matmul memory
    seconds, matmul compute seconds, L M layer-rows, KV-read seconds, 1, U L_moe expert
    calls] (L_moe: the MoE layers)."""
    rows = batch_size * num_tokens
    total = weight_seconds(shape, rows, unique_experts, machine.matmul_seconds)
    memory = weight_seconds(shape, rows, unique_experts, machine.memory_seconds)
    kv = shape.num_layers * batch_size * (context_len + num_tokens) \
        * shape.kv_bytes_per_token / machine.bandwidth
    calls = shape.num_moe_layers * unique_experts
    return np.array([memory, max(total - memory, 0.0), float(shape.num_layers * rows), kv,
                     1.0, calls])


def weight_seconds(shape: ShapeCounts, rows: int, unique_experts: float, mm) -> float:
    """Seconds of every matmul of one forward of `rows` rows, mm(rows, num_params) each."""
    matmul = shape.num_layers * mm(rows, shape.attn_params) + mm(rows, shape.head_params)
    per_layer = mm(rows, shape.mlp_params) if shape.mlp_params else 0.0
    if not shape.num_experts:
        return matmul + shape.num_layers * per_layer
    per_expert_rows = rows * shape.top_k / max(unique_experts, 1e-9)
    per_layer += mm(rows, shape.router_params)
    per_layer += unique_experts * mm(per_expert_rows, shape.expert_params)
    return (matmul + shape.num_dense_layers * mm(rows, shape.dense_mlp_params)
            + shape.num_moe_layers * per_layer)


@dataclass
class CostModel:
    """Fitted non-negative coefficients of FEATURES (`fit`), and predictions."""

    coefficients: list[float]

    def predict(self, feats: np.ndarray) -> np.ndarray:
        """feats [n, len(FEATURES)] -> predicted seconds [n]."""
        return np.atleast_2d(feats) @ np.asarray(self.coefficients)

    @classmethod
    def fit(cls, feats: np.ndarray, seconds: np.ndarray) -> "CostModel":
        """Non-negative least squares on relative error: min sum ((f c - t) / t)^2, c >= 0
        (scipy.optimize.nnls). feats [n, len(FEATURES)], seconds [n].

        Raises:
            ValueError: fewer points than coefficients.
        """
        from scipy.optimize import nnls
        feats, seconds = np.atleast_2d(feats), np.asarray(seconds, dtype=float)
        if len(seconds) < feats.shape[1]:
            raise ValueError(f"cannot fit {feats.shape[1]} coefficients to {len(seconds)} "
                             "points")
        coef, _ = nnls(feats / seconds[:, None], np.ones_like(seconds))
        return cls(coef.tolist())

    def to_json(self) -> dict:
        return dict(zip(FEATURES, self.coefficients))


def amdahl_estimate(shape: ShapeCounts, t_one: float, unique_one: float,
                    unique_t: float, batch_size: int, context_len: int) -> float:
    """Tt(B, T) ~= Tt(B, 1) ((1 - f) + f U(B, T) / U(B, 1)), f = routed experts' share of the
    bytes read at (B, 1) (weights and KV cache). Dense models: Tt(B, 1)."""
    if not shape.num_experts:
        return t_one
    s, moe_layers = shape.dtype_bytes, shape.num_moe_layers
    expert = moe_layers * unique_one * shape.expert_params * s
    rest = (shape.num_layers * shape.attn_params
            + moe_layers * (shape.mlp_params + shape.router_params)
            + shape.num_dense_layers * shape.dense_mlp_params + shape.head_params) * s
    rest += shape.num_layers * batch_size * (context_len + 1) * shape.kv_bytes_per_token
    f = expert / (expert + rest)
    return t_one * ((1.0 - f) + f * unique_t / unique_one)


def relative_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """|predicted - measured| / measured, elementwise."""
    measured = np.asarray(measured, dtype=float)
    return np.abs(np.asarray(predicted, dtype=float) - measured) / measured
