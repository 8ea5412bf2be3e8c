"""Measuring Tt(B, T): the target forward time for B requests verifying T tokens each.

A synthetic-weight preset is built in the engine's own `DecoderModel` and run through the
engine's `ModelRunner.execute` with a paged KV cache, exactly as a verification step runs:
each of the B requests has `context_len` tokens already in its KV cache and T new tokens
(the last accepted token and T - 1 drafts), and logits are computed for all T. With synthetic
weights the KV contents are zeros and the token ids random: timing does not depend on values.
A real model is timed on real text instead (`token_windows`): each request's context is
prefilled from a window of it and the T new tokens are the window's next ones, so its router
routes as it does in service.

With the model's own router, the unique experts of a point are counted in an untimed forward
over the same tokens: the counting recorder takes a MoE layer off the fused driver
(`models.fused_moe`), and the timed forward must run the path a served model runs.

MoE routing comes from a routing source (`specmoe.analysis.routing_gen`) through
`ReplayRouter`, which still runs the real router matmul (its cost is real) and then hands the
grouped experts the source's ids, generated before the timer starts. With no source, the
model's own router routes (random weights: close to uniform).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specmoe.analysis.presets import Preset, fill_synthetic_
from specmoe.bench.roofline import synchronize
from specmoe.layers.moe.backends import expert_stats, moe_blocks
from specmoe.layers.moe.replay_router import ReplayRouter
from specmoe.layers.moe.stats import ExpertStatsRecorder
from specmoe.loader.model_loader import (DTYPES, LoadedModel, default_dtype,
                                         prepare_for_inference)
from specmoe.models.decoder import DecoderModel
from specmoe.worker.model_runner import ModelRunner, SequenceInput

BLOCK_SIZE = 16


def build_synthetic(preset: Preset, dtype: str = "bfloat16", device: str = "cpu",
                    seed: int = 0, max_len: int = 4096, moe_backend: str = "auto",
                    keep_dense: bool = False) -> ModelRunner:
    """The preset as a ready-to-run `ModelRunner` with random weights (built directly in
    `dtype`, so a 3.7 GB preset needs 3.7 GB, not twice that), prepared as a loaded model
    is (`prepare_for_inference`: the MoE backend `moe_backend`, packed weights, the dense
    ones kept with `keep_dense`)."""
    arch = preset.arch()
    torch_dtype, dev = DTYPES[dtype], torch.device(device)
    with default_dtype(torch_dtype), dev:
        model = DecoderModel(arch, max_len)
    fill_synthetic_(model, seed)
    for block in moe_blocks(model):
        block.router = ReplayRouter(block.router)
    prepare_for_inference(model, dev, torch_dtype, moe_backend, keep_dense)
    loaded = LoadedModel(model, arch, Path(f"synthetic:{preset.name}"), dev, torch_dtype,
                         max_len)
    return ModelRunner(loaded)


@dataclass
class GridPoint:
    """Timings of one (B, T).

    Attributes:
        batch_size: B.
        num_tokens: T, tokens per request.
        seconds: one forward time per repetition, in seconds.
        unique_experts: per repetition, the distinct experts each MoE layer touched (the
            experts whose weights the forward read; empty for dense models).
    """

    batch_size: int
    num_tokens: int
    seconds: list[float] = field(default_factory=list)
    unique_experts: list[list[float]] = field(default_factory=list)

    @property
    def min_s(self) -> float:
        return min(self.seconds)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    def to_json(self) -> dict:
        out = {"B": self.batch_size, "T": self.num_tokens, "seconds": self.seconds,
               "min_s": self.min_s, "median_s": self.median_s}
        if self.unique_experts:
            per_layer = np.mean(self.unique_experts, axis=0)          # [num_moe_layers]
            out["unique_experts"] = float(per_layer.mean())
            out["unique_experts_per_layer"] = per_layer.tolist()
        return out


class VerifyCostBench:
    """Times forwards of one model at chosen (B, T).

    Args:
        runner: the model (a synthetic preset or any loaded model).
        routing: a routing source (one per MoE layer: a list, or one shared), or None for
            the model's own router.
        context_len: tokens already in each request's KV cache.
        max_batch_size, max_num_tokens: the largest B and T to be timed (sizes the cache).
        seed: seeds token ids and routing draws.
        token_windows: real token ids, one list per request slot (request b uses window
            b mod len), each at least context_len + max_num_tokens long: prefilled here,
            then every forward feeds the tokens after the context. None: random ids over an
            all-zero KV cache.
    Raises:
        ValueError: a token window shorter than context_len + max_num_tokens.
    """

    def __init__(self, runner: ModelRunner, routing=None, context_len: int = 512,
                 max_batch_size: int = 64, max_num_tokens: int = 8, seed: int = 0,
                 token_windows: list[list[int]] | None = None) -> None:
        self.runner = runner
        self.blocks = moe_blocks(runner.model)
        self.routing = routing if isinstance(routing, list) or routing is None \
            else [routing] * len(self.blocks)
        self.context_len = context_len
        self.blocks_per_seq = -(-(context_len + max_num_tokens) // BLOCK_SIZE)
        self.cache = runner.new_paged_cache(max_batch_size * self.blocks_per_seq, BLOCK_SIZE)
        self.rng = np.random.default_rng(seed)
        self.windows = None
        self._unique: dict[tuple[int, int], list[float]] = {}
        if token_windows is not None:
            self.windows = [list(token_windows[b % len(token_windows)])
                            for b in range(max_batch_size)]
            self._prefill(context_len + max_num_tokens)

    def _prefill(self, need: int) -> None:
        for b, window in enumerate(self.windows):
            if len(window) < need:
                raise ValueError(f"token window {b} has {len(window)} tokens; need "
                                 f"context_len + max_num_tokens = {need}")
            self.runner.execute(self.cache, [SequenceInput(
                window[:self.context_len], 0, self._block_ids(b), 0)])

    def _block_ids(self, b: int) -> list[int]:
        n = self.blocks_per_seq
        return list(range(b * n, (b + 1) * n))

    def _inputs(self, batch_size: int, num_tokens: int) -> list[SequenceInput]:
        ctx = self.context_len
        if self.windows is not None:
            tokens = [self.windows[b][ctx:ctx + num_tokens] for b in range(batch_size)]
        else:
            vocab = self.runner.vocab_size
            tokens = [self.rng.integers(vocab, size=num_tokens).tolist()
                      for _ in range(batch_size)]
        return [SequenceInput(t, ctx, self._block_ids(b), num_tokens)
                for b, t in enumerate(tokens)]

    def _set_routing(self, batch_size: int, num_tokens: int) -> list[float]:
        """Draw this forward's ids for every MoE layer; returns their unique counts."""
        unique = []
        for block, source in zip(self.blocks, self.routing):
            ids = source.sample(batch_size, num_tokens, self.rng)      # [B, T, k]
            unique.append(float(np.unique(ids).size))
            block.router.next_ids = torch.from_numpy(ids.reshape(-1, ids.shape[-1])).to(
                self.runner.device)
        return unique

    def _count_unique(self, seqs: list[SequenceInput]) -> list[float]:
        """Distinct experts per MoE layer the model's own router picks for `seqs`, from an
        untimed forward with a recorder subscribed to the model's expert-stats hub."""
        if not self.blocks:
            return []
        with expert_stats(self.runner.model).subscribed(ExpertStatsRecorder()) as recorder:
            self.runner.execute(self.cache, seqs)
        return [float(counts[-1]) for _, counts in sorted(recorder.unique_experts.items())]

    def unique_experts(self, batch_size: int, num_tokens: int,
                       seqs: list[SequenceInput] | None = None) -> list[float]:
        """Distinct experts per MoE layer at (B, T) under the model's own router (empty for a
        dense model); counted once per point on real text, every call on random ids."""
        key = (batch_size, num_tokens)
        if self.windows is None or key not in self._unique:
            self._unique[key] = self._count_unique(
                seqs or self._inputs(batch_size, num_tokens))
        return self._unique[key]

    def time_forward(self, batch_size: int, num_tokens: int) -> tuple[float, list[float]]:
        """One forward; returns (seconds, distinct experts each MoE layer touched: empty for
        a dense model)."""
        seqs = self._inputs(batch_size, num_tokens)
        if self.routing is None:
            unique = self.unique_experts(batch_size, num_tokens, seqs)
        else:
            unique = self._set_routing(batch_size, num_tokens)
        synchronize(self.runner.device)
        start = time.perf_counter()
        self.runner.execute(self.cache, seqs)
        synchronize(self.runner.device)
        return time.perf_counter() - start, unique


def measure_grid(bench: VerifyCostBench, batch_sizes: list[int], num_tokens: list[int],
                 reps: int, on_point=None) -> list[GridPoint]:
    """Tt(B, T) for every B and T, `reps` times; repetitions are the outer loop, so the
    machine's drift spreads over the whole grid, and every other repetition runs the grid
    in reverse, so no point always follows the same one (the first small forward after the
    largest ran 25% slow in both repetitions of one study). One untimed warm-up forward at
    the largest point first. `on_point()` is called after each timed forward (progress
    bars)."""
    points = {(b, t): GridPoint(b, t) for b in batch_sizes for t in num_tokens}
    bench.time_forward(max(batch_sizes), max(num_tokens))
    for rep in range(reps):
        for b, t in (list(points) if rep % 2 == 0 else reversed(list(points))):
            seconds, unique = bench.time_forward(b, t)
            points[b, t].seconds.append(seconds)
            if unique:
                points[b, t].unique_experts.append(unique)
            if on_point is not None:
                on_point()
    return list(points.values())

