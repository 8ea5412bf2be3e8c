"""`specmoe bench moe`: the MoE expert backends against each other and against the machine's
roofline, on one MoE layer and on a whole model's forward, at the token counts of decoding
(T = 1), verification (T = K + 1) and small prefill chunks.

For every case (a model shape with a routing source; `specmoe.entrypoints` builds them from
the study's synthetic presets and its correlated routing) and every T, two parts are timed:

- **layer**: one `SparseMoEBlock` of the case's shape (random weights) on x [T, H];
- **model**: the whole model's forward over one sequence of T new tokens after
  `context_len` cached ones (`ModelRunner.execute` with a paged KV cache, logits for all T),
  as a verification step runs.

Routing is forced: the real router still runs (its cost is real), then the experts get ids
drawn from the routing source before the timer starts, one draw per layer and repetition,
with equal weights 1/k. Within a repetition every backend runs on the same draw and the same
input, in the order given (ABAB...), so the per-repetition time ratios compare equal work.
The caches are flushed before every timed call (a read of twice the last-level cache), so a
layer's weights come from memory as they do in a real decode step, where the rest of the
model was read in between.

What a point reads is counted from the weights it touches: the distinct experts of each
layer (unique x one expert's bytes), plus, for the whole model, every other weight
(attention, norms, routers, LM head), the T embedding rows and the KV cache. Its matmul flops
are 2 x active parameters x T (attention scores left out, as the throughput floor leaves
them). Against the probes of the same run (read bandwidth before and after each part, the
multiply peak at the start and after every case) that gives the floor
max(bytes / bandwidth, flops / peak) and the fractions of it reached. The roofline targets
are reported, never asserted: at T <= 9, at least 85% of the bandwidth roofline of the bytes
read; at T >= 80, at least 80% of the larger floor.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from specmoe.bench.moe_accounting import (TARGETS_TEXT, backend_stats, expert_bytes,
                                         layer_active_params, layer_fixed_bytes,
                                         model_active_params, model_bytes, unique_experts)
from specmoe.bench.roofline import (measure_peak_flops, measure_read_bandwidth, synchronize,
                                    weight_bytes_per_token)
from specmoe.config import ArchConfig
from specmoe.layers.linear import prepack_weights
from specmoe.layers.moe.backends import MOE_BACKENDS, moe_blocks, set_moe_backend
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.moe.replay_router import ReplayRouter
from specmoe.loader.model_loader import DTYPES, default_dtype, resolve_device
from specmoe.utils import hugepages
from specmoe.worker.model_runner import ModelRunner, SequenceInput

DEFAULT_NUM_TOKENS = [1, 2, 5, 9, 16, 40, 80, 320]
DEFAULT_BACKENDS = ["grouped", "fused", "grouped_mm"]
LOOP_BACKEND = "grouped"  # the Python loop over active experts: the baseline of the ratios
PARTS = ("layer", "model")
BLOCK_SIZE = 16


@dataclass
class MoEBenchConfig:
    """What to run.

    Attributes:
        presets: names of the cases, for the record (the caller builds the cases).
        num_tokens: T values, ascending distinct ints >= 1.
        backends: MoE backends (`MOE_BACKENDS`), run in this order in every repetition; the
            loop backend "grouped" is the baseline of the ratios where present, else the
            first.
        parts: "layer", "model" or both.
        repeats: repetitions of every point (min and median reported).
        overlap: adjacent-token expert overlap of the correlated routing (for the record).
        context_len: tokens already in the KV cache of the whole-model step.
        dtype: "bfloat16" or "float32".
        device: torch device name (None: CUDA if present).
        probe_bytes: bytes of the read-bandwidth probe (None: max(2 GiB, 4 x cache_bytes)).
        flush_bytes: bytes read before every timed call to flush the caches (None: 2 x
            cache_bytes, or 1 GiB where unknown; 0: no flush).
        cache_bytes: the last-level cache size, if known.
        smoke: tiny shapes (for tests; the figures mean nothing).
        seed: seeds weights, inputs and routing draws.
    """

    presets: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=lambda: list(DEFAULT_NUM_TOKENS))
    backends: list[str] = field(default_factory=lambda: list(DEFAULT_BACKENDS))
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    repeats: int = 7
    overlap: float | None = None
    context_len: int = 512
    dtype: str = "bfloat16"
    device: str | None = None
    probe_bytes: int | None = None
    flush_bytes: int | None = None
    cache_bytes: int | None = None
    smoke: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.num_tokens or min(self.num_tokens) < 1 \
                or list(self.num_tokens) != sorted(set(self.num_tokens)):
            raise ValueError(f"invalid num_tokens={self.num_tokens}: ascending distinct ints "
                             ">= 1")
        unknown = [b for b in self.backends if b not in MOE_BACKENDS]
        if unknown or not self.backends or len(set(self.backends)) != len(self.backends):
            raise ValueError(f"invalid backends={self.backends}: distinct names from "
                             f"{sorted(MOE_BACKENDS)}")
        if not self.parts or any(p not in PARTS for p in self.parts):
            raise ValueError(f"invalid parts={self.parts}: choose from {list(PARTS)}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"invalid dtype={self.dtype!r}: bfloat16 or float32")
        for name, low in (("repeats", 1), ("context_len", 0), ("seed", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"invalid {name}={getattr(self, name)}: must be >= {low}")
        if self.overlap is not None and not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"invalid overlap={self.overlap}: must be in [0, 1]")

    @property
    def baseline(self) -> str:
        return LOOP_BACKEND if LOOP_BACKEND in self.backends else self.backends[0]

    def resolved_probe_bytes(self) -> int:
        if self.probe_bytes is not None:
            return self.probe_bytes
        return max(2 << 30, 4 * (self.cache_bytes or 0))

    def resolved_flush_bytes(self) -> int:
        if self.flush_bytes is not None:
            return self.flush_bytes
        return 2 * self.cache_bytes if self.cache_bytes else 1 << 30


@dataclass
class MoECase:
    """One model shape to measure.

    Attributes:
        name, description: for the report.
        arch: the whole model's architecture (`arch.moe` set: the layer part builds one
            `SparseMoEBlock` of this shape).
        routing: a routing source: `sample(num_seqs, num_tokens, rng)` -> int64
            [num_seqs, num_tokens, top_k] expert ids (`specmoe.analysis.routing_gen`).
        build_model: makes the whole model (random weights), or None to skip the model part.
    """

    name: str
    description: str
    arch: ArchConfig
    routing: object
    build_model: Callable[[], ModelRunner] | None = None


# ---------------------------------------------------------------- building


def fill_random_(module: nn.Module, seed: int) -> None:
    """Every matrix N(0, 1/fan_in), tiled from a 1M-value pool (fast for billions of
    values); vectors: norms 1, biases 0. Timing does not depend on the values."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(1 << 20, generator=gen)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
                continue
            flat = p.view(-1)
            chunk = torch.roll(pool, int(torch.randint(pool.numel(), (1,), generator=gen)))
            chunk = (chunk / p.shape[-1] ** 0.5).to(p.dtype).to(p.device)
            for start in range(0, flat.numel(), chunk.numel()):
                n = min(chunk.numel(), flat.numel() - start)
                flat[start:start + n] = chunk[:n]


def build_layer(arch: ArchConfig, dtype: torch.dtype, device: torch.device, seed: int
                ) -> SparseMoEBlock:
    """One MoE layer of `arch`'s shape with random weights and a `ReplayRouter`."""
    with default_dtype(dtype), device:
        block = SparseMoEBlock(arch.hidden_size, arch.moe, layer_idx=0)
    fill_random_(block, seed)
    block.router = ReplayRouter(block.router)
    return block.eval().requires_grad_(False)


def force_routing(model: nn.Module) -> list[SparseMoEBlock]:
    """Every MoE block of `model` with a router that takes `next_ids` (wrapped in a
    `ReplayRouter` unless it has one already)."""
    blocks = moe_blocks(model)
    for b in blocks:
        if not hasattr(b.router, "next_ids"):
            b.router = ReplayRouter(b.router)
    return blocks


def prepare_backends(module: nn.Module, backends: list[str], device: torch.device) -> None:
    """Make every backend runnable on `module` at once: the native kernel's packed copies
    (the loop backend reads them) beside the dense weights (the others read those), both
    in huge pages on CPU, as the loader places a model's weights."""
    # the loop backend first, so that the experts are packed too
    set_moe_backend(module, LOOP_BACKEND if LOOP_BACKEND in backends else backends[0])
    prepack_weights(module, release_dense=False)
    if device.type == "cpu":
        # one leaf module at a time: a copy of the whole model at once would need twice its
        # dense and packed weights (a module with tensors and children stays where it is)
        for sub in module.modules():
            if not any(True for _ in sub.children()):
                hugepages.rehome_module(sub)


# ---------------------------------------------------------------- timing


class Flusher:
    """Reads a buffer of `num_bytes` (float32) to push the weights out of the caches."""

    def __init__(self, num_bytes: int, device: torch.device) -> None:
        self.device = device
        self.buf = None
        if num_bytes > 0:
            specs = [((num_bytes // 4,), torch.float32)]
            self.buf = (hugepages.zeros_many(specs)[0] if device.type == "cpu"
                        else torch.zeros(num_bytes // 4, device=device)).fill_(1.0)

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.sum()
        synchronize(self.device)


def timed(fn: Callable[[], torch.Tensor], flush: Flusher, device: torch.device
          ) -> tuple[float, torch.Tensor]:
    """Flush the caches, then (seconds, output) of one call."""
    flush()
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for two zero tensors)."""
    a, b = a.float(), b.float()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


@dataclass
class _Draw:
    """One repetition's work at one T: `apply()` sets its inputs and routing; the unique
    experts of each layer and the bytes it reads."""

    apply: Callable[[], None]
    unique: list[int]
    bytes: float
    expert_bytes: float


def measure_points(module: nn.Module, forward: Callable[[], torch.Tensor],
                   draw: Callable[[int], _Draw], cfg: MoEBenchConfig, flush: Flusher,
                   device: torch.device, flops_of: Callable[[int], float],
                   progress: Callable[[str], None]) -> list[dict]:
    """Times `forward()` on `module` under every backend at every T: repetitions are the
    outer loop (drift spreads over the grid), the backends in turn on the same draw within
    one (ABAB...). One untimed call per backend at the largest T first. Returns the raw
    points (`summarize_points` adds the figures); the outputs of the first repetition are
    compared with the baseline backend's."""
    draw(max(cfg.num_tokens)).apply()
    for b in cfg.backends:
        set_moe_backend(module, b)
        forward()
    raw = {t: {"T": t, "seconds": {b: [] for b in cfg.backends}, "unique_experts_per_rep": [],
               "bytes_per_rep": [], "expert_bytes_per_rep": [], "flops": flops_of(t)}
           for t in cfg.num_tokens}
    for rep in range(cfg.repeats):
        for t in cfg.num_tokens:
            d, point, outs = draw(t), raw[t], {}
            d.apply()
            for b in cfg.backends:
                set_moe_backend(module, b)
                seconds, out = timed(forward, flush, device)
                point["seconds"][b].append(seconds)
                if rep == 0:
                    outs[b] = out
            point["unique_experts_per_rep"].append(d.unique)
            point["bytes_per_rep"].append(d.bytes)
            point["expert_bytes_per_rep"].append(d.expert_bytes)
            if rep == 0:
                base = outs[cfg.baseline]
                point["relative_difference_vs_baseline"] = {
                    b: relative_difference(o, base) for b, o in outs.items()}
        progress(f"repetition {rep + 1}/{cfg.repeats}")
    return list(raw.values())


def summarize_points(points: list[dict], baseline: str, bandwidth: float, peak: float
                     ) -> None:
    """Adds to each raw point (in place) its means, floors and per-backend figures against
    the probed `bandwidth` (bytes/s) and `peak` (flop/s)."""
    for p in points:
        mean_bytes = statistics.fmean(p["bytes_per_rep"])
        expert = statistics.fmean(p["expert_bytes_per_rep"])
        flops, t = p["flops"], p["T"]
        p.update({
            "unique_experts": statistics.fmean(statistics.fmean(u)
                                               for u in p["unique_experts_per_rep"]),
            "bytes": mean_bytes, "expert_bytes_read": expert,
            "other_bytes": mean_bytes - expert,
            "bandwidth_floor_s": mean_bytes / bandwidth, "compute_floor_s": flops / peak,
            "floor_s": max(mean_bytes / bandwidth, flops / peak),
            "bound": "memory" if mean_bytes / bandwidth >= flops / peak else "compute",
            "backends": {b: backend_stats(s, p["bytes_per_rep"], flops, bandwidth, peak, t,
                                          p["seconds"][baseline])
                         for b, s in p["seconds"].items()},
        })
        del p["seconds"]  # kept per backend


# ---------------------------------------------------------------- the two parts


def measure_layer(case: MoECase, cfg: MoEBenchConfig, flush: Flusher, device: torch.device,
                  progress: Callable[[str], None]) -> dict:
    """The layer part of one case (raw points)."""
    dtype = DTYPES[cfg.dtype]
    block = build_layer(case.arch, dtype, device, cfg.seed)
    prepare_backends(block, cfg.backends, device)
    h = case.arch.hidden_size
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    inputs = {t: torch.randn(t, h, generator=gen).to(dtype).to(device)
              for t in cfg.num_tokens}
    fixed, per_expert = layer_fixed_bytes(block), expert_bytes(block)
    state = {}

    def draw(t: int) -> _Draw:
        ids = source_sample(case.routing, t, rng)                       # [T, k]
        u = unique_experts(ids)
        tensor = torch.from_numpy(ids).to(device)

        def apply() -> None:
            block.router.next_ids = tensor
            state["x"] = inputs[t]
        return _Draw(apply, [u], float(fixed + u * per_expert), float(u * per_expert))

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            return block(state["x"])

    params = layer_active_params(h, case.arch.moe)
    points = measure_points(block, forward, draw, cfg, flush, device,
                            lambda t: 2.0 * params * t, progress)
    return {"expert_bytes": per_expert, "fixed_bytes": fixed,
            "active_params_per_token": params, "points": points}


def measure_model(case: MoECase, cfg: MoEBenchConfig, flush: Flusher, device: torch.device,
                  progress: Callable[[str], None]) -> dict:
    """The whole-model part of one case (raw points)."""
    runner = case.build_model()
    model, arch = runner.model, runner.arch
    blocks = force_routing(model)
    prepare_backends(model, cfg.backends, device)
    dtype_bytes = torch.empty(0, dtype=DTYPES[cfg.dtype]).element_size()
    blocks_per_seq = -(-(cfg.context_len + max(cfg.num_tokens)) // BLOCK_SIZE)
    cache = runner.new_paged_cache(blocks_per_seq, BLOCK_SIZE)
    rng = np.random.default_rng(cfg.seed + 1)
    state = {}

    def draw(t: int) -> _Draw:
        token_ids = rng.integers(arch.vocab_size, size=t).tolist()
        ids = [source_sample(case.routing, t, rng) for _ in blocks]      # per layer [T, k]
        unique = [unique_experts(i) for i in ids]
        tensors = [torch.from_numpy(i).to(device) for i in ids]
        experts, other = model_bytes(model, arch, unique, len(set(token_ids)),
                                     cfg.context_len, t, dtype_bytes)

        def apply() -> None:
            for b, ids_t in zip(blocks, tensors):
                b.router.next_ids = ids_t
            state["seqs"] = [SequenceInput(token_ids, cfg.context_len,
                                           list(range(blocks_per_seq)), t)]
        return _Draw(apply, unique, float(experts + other), float(experts))

    def forward() -> torch.Tensor:
        return runner.execute(cache, state["seqs"])

    params = model_active_params(arch)
    points = measure_points(model, forward, draw, cfg, flush, device,
                            lambda t: 2.0 * params * t, progress)
    info = {"expert_bytes": expert_bytes(blocks[0]) if blocks else 0,
            "num_moe_layers": len(blocks), "weight_bytes": weight_bytes_per_token(model),
            "active_params_per_token": params, "points": points}
    return info


def source_sample(source, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """One sequence's [T, k] ids from a routing source."""
    return np.asarray(source.sample(1, num_tokens, rng))[0].astype(np.int64)


# ---------------------------------------------------------------- the run


def environment(cfg: MoEBenchConfig, device: torch.device) -> dict:
    from specmoe.kernels import gemv
    return {"device": str(device), "torch_version": torch.__version__,
            "torch_num_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_average_start": os.getloadavg()[0],
            "native_kernel": gemv.kernel_unavailable_reason() or "available",
            "huge_pages": hugepages.supported() and device.type == "cpu",
            "cache_bytes": cfg.cache_bytes, "probe_bytes": cfg.resolved_probe_bytes(),
            "flush_bytes": cfg.resolved_flush_bytes(),
            "read_bandwidth_probes": [], "peak_probes": []}


def run_moe_bench(cfg: MoEBenchConfig, cases: list[MoECase],
                  progress: Callable[[str], None] = lambda _: None) -> dict:
    """Measures every case; returns the results (what `moe_report.write_report` writes).

    Probes: the multiply peak at the start and after every case (every point is set against
    the best of them); the read bandwidth before a case, between its parts and after it,
    each part set against the higher of the two probes around it."""
    if not cases:
        raise ValueError("no case to measure")
    for c in cases:
        if c.arch.moe is None:
            raise ValueError(f"case {c.name}: not a MoE shape")
    start = time.perf_counter()
    device = resolve_device(cfg.device)
    env = environment(cfg, device)
    dtype = DTYPES[cfg.dtype]

    def bandwidth(label: str) -> float:
        bw = measure_read_bandwidth(cfg.resolved_probe_bytes(), repeats=5, device=device)
        env["read_bandwidth_probes"].append({"when": label, "bytes_per_s": bw})
        return bw

    def peak_probe(label: str) -> None:
        rate, source = measure_peak_flops(dtype, device)
        env["peak_probes"].append({"when": label, "flops_per_s": rate, "source": source})

    peak_probe("start")
    flush = Flusher(cfg.resolved_flush_bytes(), device)
    out = []
    for case in cases:
        entry = {"name": case.name, "description": case.description,
                 "shape": _shape(case.arch),
                 "routing": getattr(case.routing, "name", type(case.routing).__name__),
                 "parts": {}}
        before = bandwidth(f"{case.name}: before")
        parts = [p for p in cfg.parts if p == "layer" or case.build_model is not None]
        for part in parts:
            progress(f"{case.name}: {part}")
            measure = measure_layer if part == "layer" else measure_model
            entry["parts"][part] = measure(case, cfg, flush, device,
                                           lambda m, n=case.name, p=part:
                                           progress(f"{n}: {p}, {m}"))
            gc.collect()
            after = bandwidth(f"{case.name}: after the {part} part")
            entry["parts"][part]["read_bandwidth"] = max(before, after)
            before = after
        peak_probe(f"after {case.name}")
        out.append(entry)
    peak = max(p["flops_per_s"] for p in env["peak_probes"])
    env["peak_flops"] = peak
    env["peak_source"] = next(p["source"] for p in env["peak_probes"]
                              if p["flops_per_s"] == peak)
    env["load_average_end"] = os.getloadavg()[0]
    for entry in out:
        for part in entry["parts"].values():
            summarize_points(part["points"], cfg.baseline, part["read_bandwidth"], peak)
    return {"config": dataclasses.asdict(cfg) | {"baseline": cfg.baseline,
                                                "targets": TARGETS_TEXT},
            "environment": env, "presets": out,
            "total_seconds": time.perf_counter() - start}


def _shape(arch: ArchConfig) -> dict:
    moe = arch.moe
    return {"num_experts": moe.num_experts, "top_k": moe.top_k,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
            "hidden_size": arch.hidden_size, "num_layers": arch.num_hidden_layers,
            "vocab_size": arch.vocab_size}
