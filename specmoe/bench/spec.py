"""`specmoe bench spec`: speculative decoding on real prompt sets, swept over proposer, K and
temperature, against our own decoding without speculation measured in the same run.

Per prompt, every configuration runs back to back (plain first), so the machine's drift hits
all of them alike. Greedy outputs with speculation are compared token for token with the
plain greedy output. Peers (transformers plain / assisted / prompt lookup, llama-cpp-python
plain / prompt lookup) run on the same weights and prompts when asked. A bandwidth probe
gives the roofline of plain decoding.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

from rich.progress import Progress

from specmoe.bench.roofline import PROBE_BYTES, measure_read_bandwidth, weight_bytes_per_token
from specmoe.sampling_params import SamplingParams
from specmoe.utils.data import load_prompts

SPEC_BENCH_CATEGORIES = ["summarization", "rag", "translation", "qa", "math_reasoning"]
PROPOSERS = ("draft", "ngram")


@dataclass
class SpecBenchConfig:
    """What to run. Defaults finish in under 30 minutes on 2 CPU cores with the Qwen pair."""

    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    quantization: str | None = None  # the target's weights: None (dtype), "int8" or "int4"
    draft_quantization: str | None = "int4"
    datasets: list[str] = field(default_factory=lambda: ["humaneval", "mt_bench", "gsm8k",
                                                         "spec_bench"])
    num_prompts: int = 1
    spec_bench_categories: list[str] = field(default_factory=lambda: list(
        SPEC_BENCH_CATEGORIES))
    proposers: list[str] = field(default_factory=lambda: ["draft", "ngram"])
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    max_tokens: int = 64
    peers: list[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class BenchPrompt:
    group: str           # dataset, or spec_bench/<category>
    token_ids: list[int]


def build_prompts(cfg: SpecBenchConfig, llm) -> list[BenchPrompt]:
    """Token ids of the prompts: HumanEval as raw code completion, the others as one chat
    turn through the target's chat template; Spec-Bench per category."""
    out = []
    for dataset in cfg.datasets:
        if dataset == "spec_bench":
            prompts = [p for c in cfg.spec_bench_categories
                       for p in load_prompts(dataset, cfg.num_prompts, categories=[c])]
        else:
            prompts = load_prompts(dataset, cfg.num_prompts)
        for p in prompts:
            text = p.text if p.is_completion else llm.chat_prompt(
                [{"role": "user", "content": p.text}])
            group = f"spec_bench/{p.category}" if dataset == "spec_bench" else dataset
            ids = llm.tokenizer.encode(text, add_special_tokens=False, verbose=False)
            out.append(BenchPrompt(group, ids))
    return out


def _run(engine, prompt: BenchPrompt, k: int, temperature: float, cfg: SpecBenchConfig,
         proposer: str) -> dict:
    sp = SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens, ignore_eos=True,
                        seed=cfg.seed, num_speculative_tokens=k)
    engine.reset_prefix_cache()  # every run computes its prompt in full, as the first did
    t = time.perf_counter()
    out = engine.generate([prompt.token_ids], sp)[0]
    seconds = time.perf_counter() - t
    s = out.spec_stats
    return {"group": prompt.group, "proposer": proposer, "k": k, "temperature": temperature,
            "num_tokens": len(out.token_ids), "seconds": seconds,
            "decode_seconds": out.metrics.decode_time_s, "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens, "num_accepted": s.num_accepted_tokens,
            "accepted_per_position": list(s.num_accepted_per_position),
            "draft_seconds": s.draft_time_s, "verify_seconds": s.verify_time_s,
            "token_ids": out.token_ids}


def run_sweep(cfg: SpecBenchConfig, engines: dict, prompts: list[BenchPrompt]) -> list[dict]:
    """Every prompt x temperature: plain, then each proposer at each K."""
    runs = []
    total = len(prompts) * len(cfg.temperatures) * (1 + len(cfg.proposers) * len(cfg.ks))
    with Progress() as progress:
        task = progress.add_task("bench spec", total=total)
        for i, prompt in enumerate(prompts):
            for temp in cfg.temperatures:
                # the machine's bandwidth drifts by tens of percent within minutes, at
                # times within seconds: probe it before and after every plain run, so the
                # roofline compares like with like
                device = engines["plain"].target.device
                before = measure_read_bandwidth(PROBE_BYTES, repeats=3, device=device)
                plain = _run(engines["plain"], prompt, 0, temp, cfg, "none")
                after = measure_read_bandwidth(PROBE_BYTES, repeats=3, device=device)
                runs.append(plain | {"prompt": i, "read_bandwidth": before,
                                     "read_bandwidth_after": after})
                progress.advance(task)
                for name in cfg.proposers:
                    for k in cfg.ks:
                        r = _run(engines[name], prompt, k, temp, cfg, name)
                        if temp == 0:
                            r["matches_plain"] = r["token_ids"] == plain["token_ids"]
                        runs.append(r | {"prompt": i})
                        progress.advance(task)
    return runs


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (group, proposer, K, temperature), plus group "all": tokens/s, speedup
    over plain at the same temperature and group, acceptance rate, mean acceptance length
    (1 + accepted / drafts), acceptance per position, greedy mismatches."""
    keyed: dict[tuple, list[dict]] = {}
    for r in runs:
        for group in (r["group"], "all"):
            keyed.setdefault((group, r["proposer"], r["k"], r["temperature"]), []).append(r)
    rows = [_row(key, rs) for key, rs in keyed.items()]
    plain = {(r["group"], r["temperature"]): r["tokens_per_s"] for r in rows
             if r["proposer"] == "none"}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / plain[(r["group"], r["temperature"])]
    return sorted(rows, key=lambda r: (r["group"], r["proposer"], r["temperature"], r["k"]))


def _row(key: tuple, rs: list[dict]) -> dict:
    group, proposer, k, temp = key
    drafts = sum(r["num_drafts"] for r in rs)
    drafted = sum(r["num_draft_tokens"] for r in rs)
    accepted = sum(r["num_accepted"] for r in rs)
    per_pos = [sum(r["accepted_per_position"][i] for r in rs
                   if i < len(r["accepted_per_position"])) / drafts if drafts else 0.0
               for i in range(k)]
    row = {"group": group, "proposer": proposer, "k": k, "temperature": temp,
           "num_runs": len(rs), "tokens_per_s": sum(r["num_tokens"] for r in rs)
           / sum(r["seconds"] for r in rs),
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
           "acceptance_per_position": per_pos}
    if "matches_plain" in rs[0]:
        row["greedy_mismatches"] = sum(not r["matches_plain"] for r in rs)
    return row


def run_bandwidth(run: dict) -> float:
    """The bandwidth a plain run is set against: the higher of the probes taken just
    before and just after it (runs from before the second probe: the first alone), so a
    change of the machine's memory speed during the run understates its roofline
    fraction, never overstates it."""
    return max(run["read_bandwidth"], run.get("read_bandwidth_after", 0.0))


def roofline(engine, runs: list[dict]) -> dict:
    """Plain greedy decode tokens/s against read bandwidth / weight bytes per token, each
    plain run against its own probes (`run_bandwidth`); the fraction reported is the
    median over runs (min and max kept), the bandwidth the median of the runs'."""
    plain = [r for r in runs if r["proposer"] == "none" and r["temperature"] == 0]
    weight_bytes = weight_bytes_per_token(engine.target.model)
    fractions = [(r["num_tokens"] - 1) / r["decode_seconds"] * weight_bytes
                 / run_bandwidth(r) for r in plain]
    bandwidth = statistics.median(run_bandwidth(r) for r in plain)
    decode_tps = sum(r["num_tokens"] - 1 for r in plain) / sum(r["decode_seconds"]
                                                               for r in plain)
    return {"read_bandwidth_gb_s": bandwidth / 1e9,
            "read_bandwidth_range_gb_s": [min(run_bandwidth(r) for r in plain) / 1e9,
                                          max(run_bandwidth(r) for r in plain) / 1e9],
            "weight_bytes_per_token": weight_bytes,
            "roofline_tokens_per_s": bandwidth / weight_bytes,
            "plain_decode_tokens_per_s": decode_tps,
            "probes_per_run": 2 if all("read_bandwidth_after" in r for r in plain) else 1,
            "fraction_of_roofline": statistics.median(fractions),
            "fraction_of_roofline_range": [min(fractions), max(fractions)]}


def build_engines(cfg: SpecBenchConfig) -> dict:
    """The plain engine and one per proposer, all sharing one loaded target."""
    from specmoe import LLM
    plain = LLM(cfg.target, dtype=cfg.dtype, quantization=cfg.quantization)
    engines = {"plain": plain}
    k = max(cfg.ks)
    if "draft" in cfg.proposers:
        engines["draft"] = plain.with_speculative(
            {"method": "draft", "draft_model": cfg.draft, "num_speculative_tokens": k,
             "draft_quantization": cfg.draft_quantization})
    if "ngram" in cfg.proposers:
        engines["ngram"] = plain.with_speculative(
            {"method": "ngram", "num_speculative_tokens": k})
    return engines


def run_spec_bench(cfg: SpecBenchConfig) -> dict:
    """Run everything `cfg` asks for; returns the JSON-ready results."""
    from specmoe.bench.spec_peers import check_peers, run_peers
    bad = [p for p in cfg.proposers if p not in PROPOSERS]
    if bad or not cfg.proposers:
        raise ValueError(f"invalid proposers={cfg.proposers}: choose from {PROPOSERS}")
    check_peers(cfg.peers)  # before the sweep: a missing peer package fails at once
    t0 = time.perf_counter()
    engines = build_engines(cfg)
    load_s = time.perf_counter() - t0
    prompts = build_prompts(cfg, engines["plain"])
    runs = run_sweep(cfg, engines, prompts)
    rows = aggregate(runs)
    from specmoe.kernels import gemv_int4
    results = {"config": dataclasses.asdict(cfg), "load_seconds": load_s, "rows": rows,
               "roofline": roofline(engines["plain"], runs), "runs": runs,
               "int4_batch_invariant": gemv_int4.batch_invariant_in_effect()}
    if cfg.peers:
        results["peers"] = run_peers(cfg, engines, prompts, rows)
    results["total_seconds"] = time.perf_counter() - t0
    return results
