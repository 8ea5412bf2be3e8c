"""The MoE x speculation study on real models: real weights, real text, the real engine.

For each target (a real MoE and a dense model of the same family, say) with one shared draft:

1. Tt(B, T), the target forward time of B requests verifying T tokens each, through the
   engine's `ModelRunner` on real text (`VerifyCostBench` with token windows from the
   held-out corpus: contexts prefilled, then the text's next T tokens), with the distinct
   experts each MoE layer's own router picked; Td(B, 1) of the draft the same way.
2. End-to-end decoding through the batched engine at each B: plain, then speculative with
   K = 1..K_max drafts per request (one engine, per-request K), interleaved, repeated; only
   the decode phase is timed (every request past its first token), so prompt prefill, which
   speculation does not change, does not dilute the speedup.
3. Predictions of every measured speedup S(B, K) = plain tokens/s over speculative tokens/s:
   from the measured forward times, from the cost model fitted on the T = 1 and T = 2
   columns of every model (`cost_model`), and from the Amdahl estimate; each with the run's
   measured acceptance length AL(B, K) and the per-step engine time outside the forwards,
   measured on the plain runs only (so no speculative timing enters a prediction).

The speedup algebra (Leviathan et al. 2023, arXiv 2211.17192, sec. 3.4; MoESD, arXiv
2505.19645) with the engine's own per-step time o(B) added to both sides:

    S(B, K) = AL (Tt(B, 1) + o(B)) / (Tt(B, K + 1) + K Td(B, 1) + (1 + K) o(B))

the draft's K forwards each paying one step's bookkeeping as well.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from specmoe.analysis import cost_model as cm
from specmoe.analysis.verify_cost import VerifyCostBench, measure_grid


@dataclass
class RealStudyConfig:
    """Settings of the real-model study.

    Attributes:
        models: target models (aliases or paths), e.g. a carved MoE and its dense source.
        draft: the draft model every target is paired with.
        batch_sizes: B of the Tt(B, T) grid, ascending.
        num_tokens: T of the grid (must include 1 and every K + 1 of `ks`).
        e2e_batch_sizes: B of the end-to-end runs (each also in `batch_sizes`).
        ks: K of the speculative end-to-end runs.
        reps: repetitions of every grid point (min taken).
        e2e_reps: repetitions of every end-to-end run (median taken).
        context_len: tokens of real text in each request's KV cache for the grid.
        prompt_tokens: the questions of the end-to-end prompts are cut to this many tokens
            (inside the chat template).
        max_tokens: tokens generated per request end to end (EOS ignored).
        dtype: the models' dtype.
        seed: engine seed and token windows.
        corpus_dir: held-out text for the grid (None: the repository's data/corpus).
    """

    models: list[str] = field(default_factory=lambda: ["qwen2.5-coder-1.5b-moe",
                                                       "qwen2.5-coder-1.5b"])
    draft: str = "qwen2.5-coder-0.5b"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 12, 16, 24, 32])
    num_tokens: list[int] = field(default_factory=lambda: list(range(1, 10)))
    e2e_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    ks: list[int] = field(default_factory=lambda: list(range(1, 9)))
    reps: int = 3
    e2e_reps: int = 2
    context_len: int = 128
    prompt_tokens: int = 96
    max_tokens: int = 48
    dtype: str = "bfloat16"
    seed: int = 0
    corpus_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no target models given")
        if 1 not in self.num_tokens:
            raise ValueError(f"num_tokens={self.num_tokens} must include 1")
        missing = sorted({k + 1 for k in self.ks} - set(self.num_tokens))
        if missing:
            raise ValueError(f"num_tokens={self.num_tokens} lacks T={missing}, the K + 1 of "
                             f"ks={self.ks}")
        extra = sorted(set(self.e2e_batch_sizes) - set(self.batch_sizes))
        if extra:
            raise ValueError(f"e2e_batch_sizes {extra} are not in batch_sizes="
                             f"{self.batch_sizes}")
        if self.reps < 1 or self.e2e_reps < 1 or self.max_tokens < 2:
            raise ValueError("reps and e2e_reps must be >= 1 and max_tokens >= 2")


def token_windows(tokenizer, cfg: RealStudyConfig) -> list[list[int]]:
    """max(B) windows of context_len + max(T) tokens of held-out corpus text (seeded)."""
    from pathlib import Path

    from specmoe.carve import calibration
    corpus = calibration.split_corpus(Path(cfg.corpus_dir) if cfg.corpus_dir
                                      else calibration.default_corpus_dir())
    return calibration.windows(tokenizer, corpus.held_out, max(cfg.batch_sizes),
                               cfg.context_len + max(cfg.num_tokens), cfg.seed).tolist()


def e2e_prompts(llm, cfg: RealStudyConfig) -> list[list[int]]:
    """max(e2e B) distinct chat prompts, Spec-Bench's own tasks (its categories in turn) and
    MT-Bench alternately, each question cut to `prompt_tokens` tokens, in the model's chat
    template, as token ids (the same ids for every target of one tokenizer)."""
    from specmoe.bench.throughput import chat_ids, distinct_question_texts
    texts = distinct_question_texts(max(cfg.e2e_batch_sizes))
    return [chat_ids(llm, _cut(llm.tokenizer, t, cfg.prompt_tokens)) for t in texts]


def _cut(tokenizer, text: str, num_tokens: int) -> str:
    """The text's first `num_tokens` tokens, as text: a long question is shortened inside
    the user message, so the chat template still ends with the assistant's turn."""
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)
    return text if len(ids) <= num_tokens else tokenizer.decode(ids[:num_tokens])


def measure_forwards(runner, windows, cfg: RealStudyConfig, num_tokens: list[int],
                     on_point=None) -> list[dict]:
    """The grid of one model on real text: [{B, T, seconds, min_s, median_s,
    unique_experts?, unique_experts_per_layer?}]."""
    bench = VerifyCostBench(runner, None, cfg.context_len, max(cfg.batch_sizes),
                            max(num_tokens), cfg.seed, token_windows=windows)
    points = measure_grid(bench, cfg.batch_sizes, num_tokens, cfg.reps, on_point)
    del bench
    gc.collect()
    return [p.to_json() for p in points]


@dataclass
class DecodeRun:
    """One end-to-end run's decode phase: seconds, tokens emitted, engine steps, and the
    speculation counts of its requests; `prefill_seconds`: the steps before it (until
    every request had its first token)."""

    seconds: float
    tokens: int
    steps: int
    drafts: int = 0
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    prefill_seconds: float = 0.0


def timed_decode(llm, prompts: list[list[int]], params) -> DecodeRun:
    """Run `prompts` to completion through `llm`'s engine; time from the step after which
    every request has its first token to the end.

    Raises:
        RuntimeError: a request failed.
    """
    llm.reset_prefix_cache()
    reqs = [llm.make_request(p, params) for p in prompts]
    for req in reqs:
        llm.add_request(req)
    engine = llm.engine
    start = time.perf_counter()
    while engine.has_unfinished_requests and not all(r.output_token_ids for r in reqs):
        engine.step()
    tokens0, steps0 = sum(len(r.output_token_ids) for r in reqs), engine.stats.num_steps
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    while engine.has_unfinished_requests:
        engine.step()
    seconds = time.perf_counter() - start
    failed = [r.error for r in reqs if r.error]
    if failed:
        raise RuntimeError(f"end-to-end run failed: {failed[0]}")
    return DecodeRun(seconds, sum(len(r.output_token_ids) for r in reqs) - tokens0,
                     engine.stats.num_steps - steps0,
                     sum(r.spec_stats.num_drafts for r in reqs),
                     sum(r.spec_stats.num_accepted_tokens for r in reqs),
                     [list(r.output_token_ids) for r in reqs], prefill_seconds)


def measure_e2e(plain, spec, prompts: list[list[int]], cfg: RealStudyConfig,
                on_run=None) -> list[dict]:
    """Plain and K = ks runs at every e2e B, interleaved (the mode order reverses on every
    repetition so drift spreads evenly): [{B, K (0: plain), identical_to_plain (greedy
    outputs equal plain decoding's: speculation is lossless), runs: [DecodeRun as dict]}]."""
    from specmoe.sampling_params import SamplingParams
    modes = [0, *cfg.ks]
    params = {k: SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True,
                                **({"num_speculative_tokens": k} if k else {}))
              for k in modes}
    for llm, k in ((plain, 0), (spec, max(cfg.ks))):  # warm-up: kernels, allocator
        timed_decode(llm, prompts[:2], params[k])
    runs: dict[tuple[int, int], list[DecodeRun]] = {}
    for rep in range(cfg.e2e_reps):
        for b in cfg.e2e_batch_sizes:
            for k in (modes if rep % 2 == 0 else modes[::-1]):
                run = timed_decode(plain if k == 0 else spec, prompts[:b], params[k])
                runs.setdefault((b, k), []).append(run)
                if on_run is not None:
                    on_run()
    return [{"B": b, "K": k, "identical_to_plain": all(
                 r.outputs == runs[b, 0][0].outputs for r in rs),
             "runs": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in rs]}
            for (b, k), rs in runs.items()]


def measure_target(model: str, cfg: RealStudyConfig, progress=None) -> dict:
    """Grid and end-to-end runs of one target with the study's draft."""
    from specmoe.engine.llm_engine import LLM
    say = progress or (lambda *_: None)
    sched = {"kv_cache_memory_bytes": 512 << 20}
    plain = LLM(model, dtype=cfg.dtype, seed=cfg.seed, scheduler=sched)
    spec = plain.with_speculative({"method": "draft", "draft_model": cfg.draft,
                                   "num_speculative_tokens": max(cfg.ks)})
    windows = token_windows(plain.tokenizer, cfg)
    say(f"Tt(B, T) of {model}")
    grid = measure_forwards(plain.target, windows, cfg, cfg.num_tokens)
    say(f"Td(B, 1) of {cfg.draft}")
    draft_grid = measure_forwards(spec.proposer.runner, windows, cfg, [1])
    say(f"end to end: {model} with {cfg.draft}")
    e2e = measure_e2e(plain, spec, e2e_prompts(plain, cfg), cfg)
    arch = plain.target.arch
    out = {"model": model, "arch": arch_summary(arch), "points": grid,
           "draft_points": draft_grid, "e2e": e2e,
           "draft_arch": arch_summary(spec.proposer.runner.arch)}
    del plain, spec
    gc.collect()
    return out


def arch_summary(arch) -> dict:
    """What the cost model needs of an architecture, JSON-ready (`ShapeCounts`)."""
    return asdict(cm.ShapeCounts.from_arch(arch))


def run_real_study(cfg: RealStudyConfig, progress=None) -> dict:
    """Everything in the module docstring: {config, machine, targets, analysis}."""
    import torch
    start = time.perf_counter()
    targets = [measure_target(m, cfg, progress) for m in cfg.models]
    machine = cm.MachineProfile.measure(getattr(torch, cfg.dtype))
    results = {"config": asdict(cfg), "machine": machine.to_json(), "targets": targets}
    results["analysis"] = analyse(results, machine)
    results["seconds"] = round(time.perf_counter() - start, 1)
    return results


# ---- analysis: everything below works on the JSON of `run_real_study`, machine-free ----

def fit_cost_model(results: dict, machine: cm.MachineProfile) -> tuple[cm.CostModel, dict]:
    """The cost model fitted on the points of T in FIT_TOKENS of every target and the
    draft; returns it and {(name, B, T): (ShapeCounts, measured point)} for every grid
    point."""
    ctx = results["config"]["context_len"]
    rows = {}
    for t in results["targets"]:
        shape = cm.ShapeCounts(**t["arch"])
        for p in t["points"]:
            rows[t["model"], p["B"], p["T"]] = (shape, p)
        draft_shape = cm.ShapeCounts(**t["draft_arch"])
        for p in t["draft_points"]:
            rows["draft", p["B"], p["T"]] = (draft_shape, p)
    base = [(s, p) for (_, _, tt), (s, p) in rows.items() if tt in cm.FIT_TOKENS]
    feats = np.stack([cm.features(s, machine, p["B"], p["T"], ctx,
                                  p.get("unique_experts", 0.0)) for s, p in base])
    model = cm.CostModel.fit(feats, np.array([p["min_s"] for _, p in base]))
    return model, rows


def analyse(results: dict, machine: cm.MachineProfile) -> dict:
    """Predicted next to measured forward times and speedups; the errors; per-target
    summaries (see `real_study_report` for the questions they answer)."""
    cfg = results["config"]
    model, rows = fit_cost_model(results, machine)
    ctx = cfg["context_len"]
    pred = {}
    for (name, b, t), (shape, p) in rows.items():
        feats = cm.features(shape, machine, b, t, ctx, p.get("unique_experts", 0.0))
        one = rows[name, b, 1][1]
        pred[name, b, t] = {
            "measured_s": p["min_s"], "predicted_s": float(model.predict(feats)[0]),
            "amdahl_s": cm.amdahl_estimate(shape, one["min_s"], one.get("unique_experts", 1.0),
                                           p.get("unique_experts", 1.0), b, ctx),
            "unique_experts": p.get("unique_experts")}
    forward_rows = [{"model": n, "B": b, "T": t, **v} for (n, b, t), v in pred.items()]
    speedups = [row for t in results["targets"] for row in _speedup_rows(t, pred, cfg)]
    return {"cost_model": model.to_json(), "forwards": forward_rows,
            "forward_errors": _forward_errors(forward_rows), "speedups": speedups,
            "speedup_errors": _speedup_errors(speedups)}


def _median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s, and the median acceptance length."""
    rate = [r["tokens"] / r["seconds"] for r in runs]
    al = [1.0 + r["accepted"] / r["drafts"] if r["drafts"] else 1.0 for r in runs]
    return {"tokens_per_s": statistics.median(rate), "AL": statistics.median(al),
            "seconds_per_step": statistics.median(r["seconds"] / max(r["steps"], 1)
                                                  for r in runs)}


def _speedup_rows(target: dict, pred: dict, cfg: dict) -> list[dict]:
    name = target["model"]
    e2e = {(r["B"], r["K"]): {**_median_run(r["runs"]), "identical": r["identical_to_plain"]}
           for r in target["e2e"]}
    out = []
    for (b, k), run in sorted(e2e.items()):
        if k == 0:
            continue
        base = e2e[b, 0]
        # the engine's time per plain step outside the target forward
        overhead = max(base["seconds_per_step"] - pred[name, b, 1]["measured_s"], 0.0)
        row = {"model": name, "B": b, "K": k, "AL": run["AL"], "identical": run["identical"],
               "measured_speedup": run["tokens_per_s"] / base["tokens_per_s"],
               "engine_overhead_s": overhead}
        for label, key in (("forward_times", "measured_s"), ("cost_model", "predicted_s"),
                           ("amdahl", "amdahl_s")):
            t_draft = pred["draft", b, 1]["measured_s" if label == "amdahl" else key]
            row[f"{label}_speedup"] = predict_speedup(
                run["AL"], k, pred[name, b, 1][key], pred[name, b, k + 1][key], t_draft,
                overhead)
        out.append(row)
    return out


def predict_speedup(tokens_per_step: float, k: int, t_one: float, t_verify: float,
                    t_draft: float, overhead: float, draft_forwards: int | None = None
                    ) -> float:
    """S(B, K) of the module docstring: tokens per step x (Tt(B, 1) + o) over
    (Tt(B, K + 1) + K Td(B, 1) + (1 + draft_forwards) o), all in seconds; draft_forwards
    defaults to K (a draft model's forwards each cost a step's bookkeeping; n-gram: 0)."""
    n = k if draft_forwards is None else draft_forwards
    return tokens_per_step * (t_one + overhead) / (t_verify + k * t_draft + (1 + n) * overhead)


def _errors(pred: list[float], measured: list[float]) -> dict:
    e = cm.relative_errors(pred, measured)
    return {"median": float(np.median(e)), "max": float(np.max(e)), "n": int(e.size)}


def _forward_errors(rows: list[dict]) -> dict:
    """Cost model and Amdahl errors on Tt, per model, on the points outside the fit."""
    out = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        pts = [r for r in rows if r["model"] == name and r["T"] not in cm.FIT_TOKENS]
        if pts:
            measured = [r["measured_s"] for r in pts]
            out[name] = {"cost_model": _errors([r["predicted_s"] for r in pts], measured),
                         "amdahl": _errors([r["amdahl_s"] for r in pts], measured)}
    return out


def _speedup_errors(rows: list[dict]) -> dict:
    """Median relative error of each prediction of S(B, K), per model and over all, and
    over the Ks whose verification the cost model did not fit (where the run has any)."""
    unfit = f"all, K>={max(cm.FIT_TOKENS)}"  # verifications of T outside the cost model's fit
    out = {}
    for scope in ["all", unfit, *dict.fromkeys(r["model"] for r in rows)]:
        pts = [r for r in rows if scope == "all" or scope == r["model"]
               or (scope == unfit and r["K"] + 1 not in cm.FIT_TOKENS)]
        if not pts:
            continue
        measured = [r["measured_speedup"] for r in pts]
        out[scope] = {label: _errors([r[f"{label}_speedup"] for r in pts], measured)
                      for label in ("forward_times", "cost_model", "amdahl")}
    return out
