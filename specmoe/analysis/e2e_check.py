"""Predicted against measured speculative speedup on a real MoE pair, end to end.

The speedup synthesis (`speedup.speedup`) predicts S(B, K) from forward times alone. Here a
real MoE target and its draft model run real prompts through the whole engine (scheduler,
paged KV cache, batched verification, rejection sampling) at batch size B, plainly and with
K drafts, interleaved, and the measured speedup (plain time / speculative time for the same
tokens) is set beside the prediction built from the same run's acceptance length and the
models' forward times Tt(B, 1), Tt(B, K + 1) and Td(B, 1) measured with `VerifyCostBench`.
The gap is what the forward-time model leaves out: the engine's per-step work outside the
forwards (sampling, scheduling, drafting bookkeeping).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from specmoe.analysis.speedup import speedup
from specmoe.analysis.verify_cost import VerifyCostBench


@dataclass
class E2EConfig:
    """The end-to-end check's settings.

    Attributes:
        model, draft: target and draft model (paths or aliases).
        k: num_speculative_tokens.
        batch_sizes: concurrent requests B.
        max_tokens: tokens generated per request (EOS ignored).
        reps: interleaved repetitions (median taken).
        dtype: the models' dtype.
        seed: engine seed.
    """

    model: str = "tiny-moe"
    draft: str = "tiny-moe-draft"
    k: int = 4
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 48
    reps: int = 2
    dtype: str = "bfloat16"
    seed: int = 0


def _prompts(llm, num: int) -> list[list[int]]:
    from specmoe.utils.data import load_prompts
    texts = [p.text for ds in ("spec_bench", "mt_bench") for p in load_prompts(ds, num)]
    return [llm.tokenizer.encode(t)[:96] for t in texts[:num]]


def _timed_generate(llm, prompts, params) -> tuple[float, float, int]:
    """(seconds, mean acceptance length over the batch, tokens generated)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    drafts = sum(o.spec_stats.num_drafts for o in outs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    return seconds, 1.0 + accepted / drafts if drafts else 1.0, tokens


def run_e2e_check(cfg: E2EConfig, on_step=None) -> dict:
    """Measured and predicted speedup at every B of `cfg` (see the module docstring)."""
    from specmoe.engine.llm_engine import LLM
    from specmoe.sampling_params import SamplingParams
    plain = LLM(cfg.model, dtype=cfg.dtype, seed=cfg.seed)
    spec = plain.with_speculative({"method": "draft", "draft_model": cfg.draft,
                                   "num_speculative_tokens": cfg.k})
    prompts = _prompts(plain, max(cfg.batch_sizes))
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    spec.generate(prompts[:2], params)  # warm-up: kernels built, allocator grown
    runs = {b: {"plain": [], "spec": [], "al": []} for b in cfg.batch_sizes}
    for _ in range(cfg.reps):
        for b in cfg.batch_sizes:
            runs[b]["plain"].append(_timed_generate(plain, prompts[:b], params)[0])
            seconds, al, _ = _timed_generate(spec, prompts[:b], params)
            runs[b]["spec"].append(seconds)
            runs[b]["al"].append(al)
            if on_step is not None:
                on_step()
    context = int(np.mean([len(p) for p in prompts])) + cfg.max_tokens // 2
    rows = [_row(b, runs[b], cfg, plain.target, spec.proposer.runner, context)
            for b in cfg.batch_sizes]
    return {"config": {**cfg.__dict__, "batch_sizes": list(cfg.batch_sizes)},
            "context_len": context, "rows": rows,
            "median_error": float(np.median([r["error"] for r in rows]))}


def _row(b: int, run: dict, cfg: E2EConfig, target, draft, context: int) -> dict:
    measured = statistics.median(p / s for p, s in zip(run["plain"], run["spec"]))
    al = statistics.median(run["al"])
    tt = VerifyCostBench(target, None, context, b, cfg.k + 1, cfg.seed)
    td = VerifyCostBench(draft, None, context, b, 1, cfg.seed)
    t_one = _min_time(tt, b, 1)
    t_verify = _min_time(tt, b, cfg.k + 1)
    t_draft = _min_time(td, b, 1)
    predicted = speedup(al, t_verify / t_one, cfg.k * t_draft / t_one)
    return {"B": b, "K": cfg.k, "AL": al, "measured_speedup": measured,
            "predicted_speedup": predicted, "error": abs(predicted - measured) / measured,
            "Tt_1_s": t_one, "Tt_K+1_s": t_verify, "Td_1_s": t_draft,
            "plain_s": run["plain"], "spec_s": run["spec"]}


def _min_time(bench: VerifyCostBench, b: int, t: int, reps: int = 5) -> float:
    bench.time_forward(b, t)
    return min(bench.time_forward(b, t)[0] for _ in range(reps))
