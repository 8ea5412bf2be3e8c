"""`specmoe advise`: will speculation pay on this model, draft and prompts, at which batch
sizes, with which K? A few minutes of measurement on the user's own setup:

1. acceptance: the target's greedy outputs on the prompts, replayed against the draft (its
   teacher-forced argmax) or n-gram lookup for every K = 1..K_max at once
   (`model_card.replay`: equal to the engine's accepted counts), giving tokens per
   verification step;
2. cost: Tt(B, T) for T = 1..K_max + 1 on the prompts' own text (`VerifyCostBench` with
   token windows), the draft model's Td(B, 1), the engine's time per plain step outside
   the forward, from a few plain decode steps at each B, and the prefill of B prompts;
3. prediction: the decode speedup S(B, K) by `real_study.predict_speedup`, the
   verification priced at the mean window the replay verified (K + 1 for a draft model;
   n-gram lookup drafts only where it finds a match, so its windows are shorter: pricing
   every window at K + 1 put the error at large B x K to 50-70%), then the end-to-end
   speedup of a run of B requests of these prompts and max_tokens each, whose prefill
   speculation does not shorten (`run_speedup`; on SmolLM2 the prefill was 26% of a
   one-request run, and leaving it out was the larger part of a 20% median error); the
   best K per B (0 where nothing beats plain decoding), and the `batch_size_table` that
   applies it.

`compare_with_bench` scores the prediction against `specmoe bench throughput`'s measured
static-K speedups at C = B (the same prompts: `datasets` selects them as the bench does).
"""

from __future__ import annotations

import gc
import gzip
import json
import statistics
from pathlib import Path
from dataclasses import asdict, dataclass, field

import numpy as np

from specmoe.analysis.model_card import (acceptance_curve, draft_acceptor,
                                         ngram_acceptor)
from specmoe.analysis.real_study import (RealStudyConfig, e2e_prompts, measure_forwards,
                                         predict_speedup, timed_decode)
from specmoe.bench.throughput import chat_ids

MAX_BATCH = 4096  # the last range of the suggested table runs to here


@dataclass
class AdviseConfig:
    """Settings of `advise`.

    Attributes:
        model: the target (alias or path).
        draft: a draft model (alias or path) or "ngram".
        prompts: prompt texts (None: Spec-Bench and MT-Bench prompts, alternately). Fewer
            than max(batch_sizes) are reused for the larger batches, which undercounts the
            experts a MoE batch touches (identical requests route identically).
        num_prompts: prompts used when `prompts` is None (None: max(batch_sizes)).
        datasets: instead of the default prompts, `bench throughput`'s data sets (its
            `--datasets`, with `spec_bench_categories`), chosen as the bench chooses them:
            with num_prompts = its --num-requests, the bench's own prompts.
        spec_bench_categories: Spec-Bench tasks for `datasets` (None: the bench's default).
        draft_quantization: None, "int8" or "int4" for the draft model's weights.
        batch_sizes: B to advise on, ascending.
        max_k: the largest K considered.
        max_tokens: greedy tokens per prompt for the acceptance replay.
        overhead_tokens: tokens per request of the plain runs that time the engine's step.
        reps: repetitions of every forward timing (min).
        dtype, seed: the models' dtype; the engine's seed.
    """

    model: str
    draft: str
    prompts: list[str] | None = None
    num_prompts: int | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    max_k: int = 8
    max_tokens: int = 64
    overhead_tokens: int = 8
    reps: int = 2
    dtype: str = "bfloat16"
    seed: int = 0
    datasets: list[str] | None = None
    spec_bench_categories: list[str] | None = None
    draft_quantization: str | None = None

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"invalid batch_sizes={self.batch_sizes}: need ints >= 1")
        self.batch_sizes = sorted(set(self.batch_sizes))
        if not 1 <= self.max_k <= 16:
            raise ValueError(f"invalid max_k={self.max_k}: must be in 1..16")
        if self.max_tokens < self.max_k + 2 or self.overhead_tokens < 2:
            raise ValueError(f"max_tokens={self.max_tokens} must exceed max_k + 1 and "
                             f"overhead_tokens={self.overhead_tokens} be >= 2")
        if self.prompts is not None and not [p for p in self.prompts if p.strip()]:
            raise ValueError("no non-empty prompt given")
        if self.prompts is not None and self.datasets:
            raise ValueError("give prompts or datasets, not both")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"invalid num_prompts={self.num_prompts}: must be >= 1")


def _prompt_ids(llm, cfg: AdviseConfig) -> list[list[int]]:
    if cfg.datasets:
        return _bench_prompt_ids(llm, cfg)
    if cfg.prompts is None:
        n = cfg.num_prompts or max(cfg.batch_sizes)
        study = RealStudyConfig(models=[cfg.model], e2e_batch_sizes=[n], batch_sizes=[n])
        return e2e_prompts(llm, study)
    return [chat_ids(llm, p) for p in cfg.prompts if p.strip()]


def _bench_prompt_ids(llm, cfg: AdviseConfig) -> list[list[int]]:
    """The prompts `bench throughput --datasets ... --num-requests num_prompts` runs (those
    that fit the context with max_tokens more)."""
    from specmoe.bench.throughput import (SPEC_BENCH_CATEGORIES, ThroughputBenchConfig,
                                          build_prompts, fitting_prompts)
    n = cfg.num_prompts or max(cfg.batch_sizes)
    bench = ThroughputBenchConfig(
        model=cfg.model, datasets=cfg.datasets, num_requests=n, concurrency=[n],
        spec_bench_categories=cfg.spec_bench_categories or SPEC_BENCH_CATEGORIES)
    fit, _ = fitting_prompts(build_prompts(bench, llm), cfg.max_tokens, llm.max_model_len)
    return [p["token_ids"] for p in fit]


def measure_acceptance(draft_runner, prompts, outputs, max_k: int, lookup) -> list[dict]:
    """tokens per step and 1 + accepted / drafts for K = 1..max_k (`acceptance_curve`)."""
    if draft_runner is None:
        acceptors = [ngram_acceptor(p, o, lookup) for p, o in zip(prompts, outputs)]
    else:
        acceptors = [draft_acceptor(draft_runner, p, o) for p, o in zip(prompts, outputs)]
    return acceptance_curve(acceptors, [len(o) for o in outputs], max_k)


def measure_engine_steps(llm, prompts, cfg: AdviseConfig, tt_one: dict[int, float]
                         ) -> dict[int, dict[str, float]]:
    """B -> {"overhead_s": the engine's seconds per plain decode step beyond Tt(B, 1) (>= 0),
    "prefill_s": seconds until B prompts of the mean length all have their first token
    (measured on B of the prompts, scaled by tokens)}; the least of `reps` runs each."""
    from specmoe.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=cfg.overhead_tokens, temperature=0.0, ignore_eos=True)
    mean_len = statistics.fmean(len(p) for p in prompts)
    out = {}
    for b in cfg.batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        runs = [timed_decode(llm, batch, params) for _ in range(cfg.reps)]
        out[b] = {"overhead_s": max(min(r.seconds / max(r.steps, 1) for r in runs)
                                    - tt_one[b], 0.0),
                  "prefill_s": min(r.prefill_seconds for r in runs)
                  * b * mean_len / sum(len(p) for p in batch)}
    return out


def verify_seconds(tt: dict[tuple[int, int], float], b: int, window: float) -> float:
    """Tt(B, window) for a mean window between measured T, linearly interpolated.

    Raises:
        ValueError: the window is outside the measured T.
    """
    ts = sorted(t for bb, t in tt if bb == b)
    if not ts or not ts[0] <= window <= ts[-1]:
        raise ValueError(f"window {window} outside the measured T {ts} at B={b}")
    return float(np.interp(window, ts, [tt[b, t] for t in ts]))


def run_speedup(decode_speedup: float, prefill_s: float, plain_decode_s: float) -> float:
    """The end-to-end speedup of a run whose prefill takes `prefill_s` and whose plain
    decode `plain_decode_s`, when speculation divides the decode time by
    `decode_speedup`."""
    return (prefill_s + plain_decode_s) / (prefill_s + plain_decode_s / decode_speedup)


def predict_row(b: int, a: dict, tt: dict, td: float, steps: dict, cfg: AdviseConfig
                ) -> dict:
    """One (B, K) of the advice (module docstring, item 3); `a`: the replay's acceptance
    at this K, `steps`: `measure_engine_steps` at this B."""
    ngram = cfg.draft == "ngram"
    window = 1 + a["drafted"] / max(a["steps"], 1) if ngram else a["k"] + 1
    t_verify = verify_seconds(tt, b, window)
    o = steps["overhead_s"]
    decode = predict_speedup(a["tokens_per_step"], a["k"], tt[b, 1], t_verify, td, o,
                             0 if ngram else None)
    plain_decode = (cfg.max_tokens - 1) * (tt[b, 1] + o)
    return {"B": b, "K": a["k"], "tokens_per_step": a["tokens_per_step"],
            "predicted_speedup": run_speedup(decode, steps["prefill_s"], plain_decode),
            "decode_speedup": decode, "verify_window": window, "Tt_1_s": tt[b, 1],
            "Tt_window_s": t_verify, "Td_1_s": td, "engine_overhead_s": o,
            "prefill_s": steps["prefill_s"]}


def advise(cfg: AdviseConfig, progress=None) -> dict:
    """Everything in the module docstring, JSON-ready: {config, context_len, prompt_tokens
    (each prompt's length), acceptance, tt (the measured Tt(B, T)), rows (per B and K: the
    end-to-end `predicted_speedup`, the `decode_speedup` and the times behind them), best,
    batch_size_table}."""
    from specmoe.config import SpeculativeConfig
    from specmoe.engine.llm_engine import LLM
    from specmoe.sampling_params import SamplingParams
    say = progress or (lambda *_: None)
    llm = LLM(cfg.model, dtype=cfg.dtype, seed=cfg.seed,
              scheduler={"kv_cache_memory_bytes": 512 << 20})
    spec = SpeculativeConfig(**({"method": "ngram"} if cfg.draft == "ngram" else
                                {"method": "draft", "draft_model": cfg.draft,
                                 "draft_quantization": cfg.draft_quantization}))
    draft_llm = None if cfg.draft == "ngram" else llm.with_speculative(spec)
    draft_runner = draft_llm.proposer.runner if draft_llm else None
    prompts = _prompt_ids(llm, cfg)
    say(f"greedy outputs of {len(prompts)} prompts")
    outputs = [o.token_ids for o in llm.generate(prompts, SamplingParams(
        max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True))]
    say("acceptance")
    acceptance = measure_acceptance(draft_runner, prompts, outputs, cfg.max_k,
                                    (spec.prompt_lookup_min, spec.prompt_lookup_max))
    say("Tt(B, T)")
    windows = [p + o for p, o in zip(prompts, outputs)]
    ctx = min(128, min(len(w) for w in windows) - cfg.max_k - 1)
    if ctx < 4:
        raise ValueError(f"a prompt and its {cfg.max_tokens} output tokens are too short for "
                         f"windows of K_max + 1 = {cfg.max_k + 1} tokens: raise max_tokens")
    grid_cfg = RealStudyConfig(models=[cfg.model], batch_sizes=cfg.batch_sizes,
                               num_tokens=list(range(1, cfg.max_k + 2)),
                               e2e_batch_sizes=cfg.batch_sizes, ks=list(range(1, cfg.max_k + 1)),
                               reps=cfg.reps, context_len=ctx, seed=cfg.seed)
    tt = {(p["B"], p["T"]): p["min_s"] for p in measure_forwards(
        llm.target, windows, grid_cfg, grid_cfg.num_tokens)}
    td = ({p["B"]: p["min_s"] for p in measure_forwards(draft_runner, windows, grid_cfg, [1])}
          if draft_runner is not None else {b: 0.0 for b in cfg.batch_sizes})
    say("engine time per step and prefill")
    steps = measure_engine_steps(llm, prompts, cfg, {b: tt[b, 1] for b in cfg.batch_sizes})
    del llm, draft_llm, draft_runner
    gc.collect()
    rows = [predict_row(b, a, tt, td[b], steps[b], cfg)
            for b in cfg.batch_sizes for a in acceptance]
    best = best_k(rows)
    return {"config": asdict(cfg), "context_len": ctx,
            "prompt_tokens": [len(p) for p in prompts], "acceptance": acceptance,
            "tt": [{"B": b, "T": t, "seconds": s} for (b, t), s in sorted(tt.items())],
            "rows": rows, "best": best, "batch_size_table": batch_size_table(best)}


def best_k(rows: list[dict]) -> dict[int, dict]:
    """B -> {K, predicted_speedup} of the fastest K, K = 0 (speedup 1) where none beats
    plain decoding."""
    out = {}
    for b in sorted({r["B"] for r in rows}):
        top = max((r for r in rows if r["B"] == b), key=lambda r: r["predicted_speedup"])
        out[b] = ({"K": top["K"], "predicted_speedup": top["predicted_speedup"]}
                  if top["predicted_speedup"] > 1.0 else {"K": 0, "predicted_speedup": 1.0})
    return out


def batch_size_table(best: dict[int, dict]) -> dict[str, int]:
    """vLLM-style ranges: each measured B holds up to the next one, the last to MAX_BATCH;
    neighbouring ranges with the same K merged."""
    bs = sorted(best)
    ranges: list[list[int]] = []
    for i, b in enumerate(bs):
        hi = bs[i + 1] - 1 if i + 1 < len(bs) else MAX_BATCH
        lo = 1 if i == 0 else b
        k = best[b]["K"]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi, k])
    return {f"{lo}-{hi}": k for lo, hi, k in ranges}


def median_error(predicted: dict[tuple[int, int], float],
                 measured: dict[tuple[int, int], float]) -> float:
    """Median |predicted - measured| / measured over the (B, K) both have."""
    keys = sorted(set(predicted) & set(measured))
    if not keys:
        raise ValueError("no (B, K) in common")
    return statistics.median(abs(predicted[k] - measured[k]) / measured[k] for k in keys)


def read_results(path: str | Path) -> dict:
    """A JSON results file (`advice.json`, bench throughput's `results.json`), gzipped or
    not.

    Raises:
        ValueError: no such file, or not JSON.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: no such file")
    opener = gzip.open if file.suffix == ".gz" else open
    try:
        with opener(file, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a JSON results file ({exc})") from exc


def compare_with_bench(advice: dict, bench: dict) -> dict:
    """The advice's predicted S(B, K) against `bench throughput`'s measured speedups of its
    static:K modes at C = B (the median over repetitions of tokens/s over plain).

    Returns:
        {"rows": [{B, K, predicted, measured, error}], "median_error", "best": {B: (advised
        K, measured best static K)}}, JSON-ready.
    Raises:
        ValueError: no (B, K) in common (no static:K mode at a C the advice covers).
    """
    measured = {}
    for mode, by_c in bench["ratios"].get("speedup_by_mode", {}).items():
        if mode.startswith("static:"):
            for c, r in by_c.items():
                measured[int(c), int(mode.split(":")[1])] = r["median"]
    predicted = {(r["B"], r["K"]): r["predicted_speedup"] for r in advice["rows"]}
    keys = sorted(set(predicted) & set(measured))
    if not keys:
        raise ValueError("no (B, K) in common: the bench needs static:K modes at the "
                         "advice's batch sizes")
    rows = [{"B": b, "K": k, "predicted": predicted[b, k], "measured": measured[b, k],
             "error": abs(predicted[b, k] - measured[b, k]) / measured[b, k]}
            for b, k in keys]
    advised = {int(b): v["K"] for b, v in advice["best"].items()}  # JSON keys are str
    best = {}
    for b in sorted({b for b, _ in keys}):
        top = max((r for r in rows if r["B"] == b), key=lambda r: r["measured"])
        best[b] = {"advised_K": advised[b],
                   "measured_best_K": top["K"] if top["measured"] > 1.0 else 0}
    return {"rows": rows, "median_error": median_error(predicted, measured), "best": best}
