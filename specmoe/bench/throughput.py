"""`specmoe bench throughput`: offline throughput and latency against concurrency, with and
without speculation, on real prompts.

For each concurrency C, C requests run at a time through the engine (greedy, EOS ignored,
`max_tokens` each) and the wall time is measured. So that every C sees the same prompt mix (a
C=1 baseline on one short prompt would flatter nothing and measure little), a run at C <
num_requests processes the first num_requests prompts, keeping C in flight, the next
submitted as soon as one finishes (`arrival="closed"`: a closed loop, the
`--max-concurrency` of vLLM's and SGLang's serving benchmarks), or in successive waves of C
submitted at once (`arrival="waves"`); a run at C >= num_requests is one wave of C distinct
prompts. Waves end on their slowest request: where speculation lets some requests of a wave
finish early, the rest of the wave runs a smaller batch, which a server with requests
waiting would not. The engine's counters (`EngineStats`) are reset before each run and the
target's prefix cache is emptied, so every run starts cold. Modes are interleaved: each
repetition sweeps every C, and at each C the modes' runs take turns of half a second of
stepping (`interleave="slice"`; "wave": wave by wave; "run": whole runs, plain then
speculative; `throughput_run`), so the machine's drift hits every mode (and every C) alike,
and the ratios (throughput at C over plain throughput at C=1, speculative over plain at C)
are taken within one repetition and summarised by their median.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from specmoe.bench.throughput_floor import MatmulCounts, run_floor_seconds
from specmoe.bench.throughput_stats import (AA_MODE, aggregate, ratios, slowest_steps,
                                            target_line)
from specmoe.config import ArchConfig, ExpertParallelConfig, parse_draft
from specmoe.engine.kv_cache_manager import blocks_for_requests
from specmoe.bench.throughput_run import (ARRIVALS, INTERLEAVE, SLICE_SECONDS, output_len_range,
                                          run_interleaved)
from specmoe.loader.aliases import DEFAULT_MODEL
from specmoe.utils.data import DATASETS, load_prompts

SPEC_BENCH_CATEGORIES = ["summarization", "rag", "translation", "qa", "math_reasoning"]


@dataclass
class ThroughputBenchConfig:
    """What to run. Defaults finish in about 15 minutes on 2 CPU cores with smollm2-135m.

    Attributes:
        model: target model (path or alias).
        draft: "ngram" (prompt lookup), "self:experts=K" (a MoE target drafting with K of
            its experts), a draft model path/alias, or "none" (plain only).
        num_speculative_tokens: K of the speculative mode (K_max of "adaptive").
        spec_disable_by_batch_size: the speculative mode pauses speculation while at least
            this many requests run (`SpeculativeConfig.disable_by_batch_size`; None: never).
        policies: speculative modes by policy, each against plain in the same sweep:
            "static:K" (every request drafts K), "table" (`batch_size_table`),
            "adaptive" (`SpeculativeConfig.policy`) and "adaptive:notrim" (adaptive
            without `match_trim`); empty: the one mode "spec" (static
            num_speculative_tokens with spec_disable_by_batch_size).
        batch_size_table: the "table" policy's ranges, vLLM style ({"1-4": 4, ...}).
        aa_control: also run AA_MODE, a second engine without speculation over the same
            target, interleaved like the others: its tokens/s over plain's is the A/A
            control, the band within which two identical engines disagree in this run, the
            noise floor of every ratio to plain (two plain tiny-moe engines read
            0.96-1.05x each other, medians over 8 repetitions at 1 and 16 requests).
        spec_bench_categories: the Spec-Bench tasks prompts are drawn from.
        expert_parallel_size: processes a MoE target's experts are sharded over (1: none).
        expert_parallel_dispatch, expert_placement, expert_parallel_timeout_s: the
            expert-parallel dispatch mode, placement and timeout (`LLM`'s arguments of the
            same names).
        concurrency: numbers of requests submitted at once, ascending; the first is the
            baseline of the scaling ratios (1 for the target line).
        max_tokens: tokens generated per request (EOS ignored); with
            `max_tokens_range_ratio` R, their mean.
        max_tokens_range_ratio: R in [0, 1): each prompt's output length drawn uniformly
            from the integers in [max_tokens (1 - R), max_tokens (1 + R)] (seeded by
            `seed`: every mode and repetition gives a prompt the same length), as vLLM's
            benchmark `--random-range-ratio`. With 0 every request has max_tokens, and
            requests started together finish together: a mode whose requests drift apart
            (speculation emits more tokens on some steps) pays for it in prompts prefilled
            one at a time and a ragged end, which a real workload's spread of lengths
            imposes on every mode.
        reps: repetitions of the whole sweep.
        interleave: "slice" (the modes' runs at one C alternate every `slice_seconds` of
            stepping: the fairest under a drifting machine), "wave" (they alternate wave
            by wave; a closed loop's run is one wave) or "run" (whole runs, one mode after
            another).
        slice_seconds: a mode's turn with interleave "slice".
        arrival: "closed" (a run at C < num_requests keeps C requests in flight, as one
            wave) or "waves" (it submits waves of C, the default before 2026-12-05).
        datasets: prompt sets, interleaved; each is taken round-robin over its categories.
        num_requests: requests of a run at C < num_requests (see arrival); a run at a larger
            C has C requests. max(num_requests, max(concurrency)) distinct prompts are used
            (cycled only if the data sets run out). The default, target_concurrency, makes
            the target line compare C=1 and C=16 on the same 16 prompts (with 8, C=1 saw the
            first 8 and C=16 sixteen whose mean length is 26% longer).
        max_num_batched_tokens: token budget of one engine step.
        num_kv_blocks: KV cache blocks of the target (None: sized by the engine).
        num_threads: torch intra-op threads (None: torch's default).
        target_concurrency, target_ratio: the target line: at target_concurrency requests,
            plain tokens/s >= target_ratio x plain tokens/s at C=1.
    """

    model: str = DEFAULT_MODEL
    draft: str = "ngram"
    num_speculative_tokens: int = 4
    spec_disable_by_batch_size: int | None = None
    dtype: str = "float32"
    quantization: str | None = None
    draft_quantization: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    max_tokens: int = 96
    max_tokens_range_ratio: float = 0.0
    reps: int = 2
    datasets: list[str] = field(default_factory=lambda: ["spec_bench", "mt_bench"])
    num_requests: int = 16
    max_num_batched_tokens: int = 1024
    num_kv_blocks: int | None = None
    num_threads: int | None = None
    target_concurrency: int = 16
    target_ratio: float = 6.0
    seed: int = 0
    policies: list[str] = field(default_factory=list)
    batch_size_table: dict | None = None
    aa_control: bool = False
    spec_bench_categories: list[str] = field(default_factory=lambda: list(
        SPEC_BENCH_CATEGORIES))
    expert_parallel_size: int = 1
    expert_parallel_dispatch: str = "replicated"
    expert_placement: str = "contiguous"
    expert_parallel_timeout_s: float = 60.0
    interleave: str = "slice"
    slice_seconds: float = SLICE_SECONDS
    arrival: str = "closed"

    def __post_init__(self) -> None:
        if not self.concurrency or any(not isinstance(c, int) or c < 1
                                       for c in self.concurrency):
            raise ValueError(f"invalid concurrency={self.concurrency}: need ints >= 1")
        self.concurrency = sorted(set(self.concurrency))
        for name in ("max_tokens", "reps", "num_requests", "num_speculative_tokens",
                     "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid {name}={getattr(self, name)}: must be >= 1")
        if self.interleave not in INTERLEAVE:
            raise ValueError(f"invalid interleave={self.interleave!r}: one of {INTERLEAVE}")
        if not 0.0 <= self.max_tokens_range_ratio < 1.0:
            raise ValueError(f"invalid max_tokens_range_ratio={self.max_tokens_range_ratio}:"
                             " must be in [0, 1)")
        if not self.slice_seconds > 0:
            raise ValueError(f"invalid slice_seconds={self.slice_seconds}: must be > 0")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"invalid arrival={self.arrival!r}: one of {ARRIVALS}")
        bad = [d for d in self.datasets if d not in DATASETS]
        if bad or not self.datasets:
            raise ValueError(f"invalid datasets={self.datasets}: choose from {DATASETS}")
        for policy in self.policies:
            policy_speculative(policy, self.num_speculative_tokens, self.batch_size_table)
        if self.policies and self.draft == "none":
            raise ValueError("speculation policies need a draft: --draft is 'none'")
        ExpertParallelConfig(self.expert_parallel_size, self.expert_parallel_dispatch,
                             self.expert_placement, self.expert_parallel_timeout_s
                             )  # raises on a bad value, before loading

    @property
    def output_len_range(self) -> tuple[int, int]:
        """The least and most tokens a request generates (`max_tokens_range_ratio`)."""
        return output_len_range(self.max_tokens, self.max_tokens_range_ratio)

    @property
    def modes(self) -> list[str]:
        plain = ["plain", AA_MODE] if self.aa_control else ["plain"]
        if self.draft == "none":
            return plain
        return [*plain, *self.policies] if self.policies else [*plain, "spec"]


def policy_speculative(policy: str, k_max: int, table: dict | None) -> dict:
    """The `SpeculativeConfig` fields of a policy mode (see ThroughputBenchConfig.policies).

    Raises:
        ValueError: an unknown policy, a bad static K, or "table" without a table.
    """
    if policy in ("adaptive", "adaptive:notrim"):
        return {"policy": "adaptive", "num_speculative_tokens": k_max,
                "match_trim": policy != "adaptive:notrim"}
    if policy == "table":
        if not table:
            raise ValueError("policy 'table' needs a batch_size_table")
        return {"policy": "batch_size_table", "batch_size_table": table,
                "num_speculative_tokens": max(table.values())}
    name, _, k = policy.partition(":")
    if name == "static" and k.isdigit() and 1 <= int(k) <= 64:
        return {"policy": "static", "num_speculative_tokens": int(k)}
    raise ValueError(f"invalid policy {policy!r}: expected static:K (1 <= K <= 64), table, "
                     "adaptive or adaptive:notrim")


# ---------------------------------------------------------------- prompts


def build_prompts(cfg: ThroughputBenchConfig, llm) -> list[dict]:
    """max(num_requests, max(concurrency)) prompts, data sets interleaved; each {"dataset",
    "category", "token_ids"}, the chat template applied when the model has one (HumanEval
    stays raw)."""
    pool = max(cfg.num_requests, max(cfg.concurrency))
    per_set = [round_robin(_load(d, cfg.spec_bench_categories), -(-pool // len(cfg.datasets)))
               for d in cfg.datasets]
    out = []
    for i in range(max(len(p) for p in per_set)):
        for prompts in per_set:
            if i < len(prompts):
                p = prompts[i]
                out.append({"dataset": p.dataset, "category": p.category,
                            "token_ids": _encode(llm, p)})
    return out[:pool]


def assign_output_lengths(prompts: list[dict], cfg: ThroughputBenchConfig) -> None:
    """Give each prompt its "max_tokens" (`max_tokens_range_ratio`); none where R is 0."""
    import numpy as np
    lo, hi = cfg.output_len_range
    if lo == hi:
        return
    lengths = np.random.default_rng(cfg.seed).integers(lo, hi + 1, size=len(prompts))
    for prompt, n in zip(prompts, lengths.tolist()):
        prompt["max_tokens"] = n


def fitting_prompts(prompts: list[dict], max_tokens: int,
                    max_model_len: int) -> tuple[list[dict], list[dict]]:
    """(prompts that fit, prompts skipped): a prompt fits when its tokens plus `max_tokens`
    output tokens are at most `max_model_len` (every request generates max_tokens, EOS
    ignored; a longer one would be refused, or cut short at the context's end)."""
    fit = [p for p in prompts if len(p["token_ids"]) + max_tokens <= max_model_len]
    skipped = [p for p in prompts if len(p["token_ids"]) + max_tokens > max_model_len]
    return fit, skipped


def _load(dataset: str, spec_bench_categories: list[str] = SPEC_BENCH_CATEGORIES):
    if dataset == "spec_bench":  # its first 80 rows repeat MT-Bench: take its own tasks
        return load_prompts(dataset, categories=spec_bench_categories)
    return load_prompts(dataset)


def round_robin(prompts: list, n: int) -> list:
    """n prompts taking the categories in turn (file order within each)."""
    by_cat: dict[str, list] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    queues = list(by_cat.values())
    out: list = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def distinct_question_texts(n: int) -> list[str]:
    """n distinct questions, Spec-Bench's own tasks (its categories in turn) and MT-Bench
    alternately (the in-repo prompt sets). Distinct: identical requests route identically,
    which would undercount the experts a MoE batch touches."""
    sets = [round_robin(load_prompts("spec_bench", categories=SPEC_BENCH_CATEGORIES), n),
            load_prompts("mt_bench", n)]
    return [p.text for pair in zip(*sets) for p in pair][:n]


def _encode(llm, prompt) -> list[int]:
    if prompt.is_completion:
        return llm.tokenizer.encode(prompt.text, add_special_tokens=False, verbose=False)
    return chat_ids(llm, prompt.text)


def chat_ids(llm, text: str) -> list[int]:
    """`text` as one user message in the model's chat template (raw without one), as ids."""
    try:
        text = llm.chat_prompt([{"role": "user", "content": text}])
    except ValueError:  # no chat template: the raw text
        pass
    return llm.tokenizer.encode(text, add_special_tokens=False, verbose=False)


# ---------------------------------------------------------------- running


def build_engines(cfg: ThroughputBenchConfig) -> dict:
    """{"plain": LLM}: the target, loaded once; `add_speculative_engines` adds the rest."""
    from specmoe import LLM
    sched = {"max_num_seqs": max(cfg.concurrency),
             "max_num_batched_tokens": cfg.max_num_batched_tokens,
             "num_kv_blocks": cfg.num_kv_blocks}
    return {"plain": LLM(cfg.model, dtype=cfg.dtype, quantization=cfg.quantization,
                         seed=cfg.seed, scheduler=sched,
                         expert_parallel_size=cfg.expert_parallel_size,
                         expert_parallel_dispatch=cfg.expert_parallel_dispatch,
                         expert_placement=cfg.expert_placement,
                         expert_parallel_timeout_s=cfg.expert_parallel_timeout_s)}


def add_speculative_engines(cfg: ThroughputBenchConfig, engines: dict,
                            num_kv_blocks: int | None) -> None:
    """engines["spec"] (or one engine per policy) over the plain engine's target; a draft
    model is loaded once and shared by all of them, each with KV caches of `num_kv_blocks`
    blocks (None: as the plain engine's); with `aa_control`, engines[AA_MODE] as well, a
    second engine without speculation sized as the plain one."""
    plain = engines["plain"]
    if cfg.aa_control:
        engines[AA_MODE] = plain.with_speculative(None)
    if cfg.draft == "none":
        return
    spec = parse_draft(cfg.draft)
    if spec["method"] == "draft":
        spec["draft_quantization"] = cfg.draft_quantization
    if not cfg.policies:
        engines["spec"] = plain.with_speculative(
            spec | {"num_speculative_tokens": cfg.num_speculative_tokens,
                    "disable_by_batch_size": cfg.spec_disable_by_batch_size}, num_kv_blocks)
    for policy in cfg.policies:
        engines[policy] = plain.with_speculative(spec | policy_speculative(
            policy, cfg.num_speculative_tokens, cfg.batch_size_table), num_kv_blocks)


def workload_kv_blocks(cfg: ThroughputBenchConfig, prompts: list[dict],
                       block_size: int) -> int | None:
    """KV cache blocks for max(concurrency) requests of the longest prompt plus max_tokens
    and the drafts (sized as the engine sizes its own, `blocks_for_requests`), so the
    speculative engines hold no more cache than the sweep uses; None when --num-kv-blocks
    is given."""
    if cfg.num_kv_blocks is not None:
        return None
    longest = max(len(p["token_ids"]) for p in prompts)
    return blocks_for_requests(max(cfg.concurrency),
                               longest + cfg.output_len_range[1] + cfg.num_speculative_tokens,
                               block_size)


def run_sweep(cfg: ThroughputBenchConfig, engines: dict, prompts: list[dict]) -> list[dict]:
    """Every repetition x concurrency, all modes interleaved (`cfg.interleave`: slice by
    slice or wave by wave, `run_interleaved` over all modes, repetition r starting at row r
    of its balanced orders; or run by run, plain then the others), with a progress bar in
    output tokens. A run that raises is kept with its "error" and the sweep goes on."""
    from rich.progress import Progress
    runs = []
    total = cfg.reps * len(cfg.modes) * cfg.max_tokens * sum(
        max(c, cfg.num_requests) for c in cfg.concurrency)
    groups = [[m] for m in cfg.modes] if cfg.interleave == "run" else [list(cfg.modes)]
    slice_s = cfg.slice_seconds if cfg.interleave == "slice" else None
    with Progress() as progress:
        task = progress.add_task("bench throughput", total=total)

        def advance(_mode: str, num_requests: int) -> None:
            progress.advance(task, num_requests * cfg.max_tokens)
        for rep in range(cfg.reps):
            for c in cfg.concurrency:
                for modes in groups:
                    progress.update(task, description=f"rep {rep + 1} C={c} {', '.join(modes)}")
                    done = run_interleaved(engines, modes, prompts, c, cfg.max_tokens,
                                           cfg.num_requests, advance, cfg.arrival,
                                           start=rep, slice_seconds=slice_s)
                    runs += [{"mode": m, "rep": rep} | done[m] for m in modes]
    return runs


def warm_up(engines: dict, prompts: list[dict], max_batches: int = 8) -> None:
    """One short untimed batch per engine (first-call allocations, lazy imports); an
    adaptive policy's engine runs more (at most `max_batches`) until its time models are
    fitted (`AdaptivePolicy.calibrated`): until then it drafts the requests' own K, a cold
    start a server pays once, not in every run, which cost the first run at one request on
    the 50%-carved Qwen2.5-Coder MoE four steps at K = 4 and their draft catch-up."""
    from specmoe.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for llm in engines.values():
        for _ in range(max_batches):
            llm.generate([p["token_ids"] for p in prompts[:2]], params)
            if llm.engine.policy.calibrated:
                break


def run_throughput_bench(cfg: ThroughputBenchConfig) -> dict:
    """Run everything `cfg` asks for; returns the JSON-ready results. Prompts too long for
    the context with max_tokens more (`fitting_prompts`) are left out and listed under
    "skipped_prompts"; a run that fails is kept with its "error" (`num_failed_runs`).

    Raises:
        ValueError: no prompt fits the model's context with max_tokens more.
    """
    import torch

    from specmoe.kernels import gemv_int4
    if cfg.num_threads is not None:
        from specmoe.utils.threads import pin_thread_count
        torch.set_num_threads(cfg.num_threads)
        pin_thread_count()
    t0 = time.perf_counter()
    env = {"torch_num_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "load_average_start": os.getloadavg()[0], "torch_version": torch.__version__,
           "int4_batch_invariant": gemv_int4.batch_invariant_in_effect()}
    engines = build_engines(cfg)
    try:
        return _bench(cfg, engines, env, t0)
    finally:
        engines["plain"].shutdown()  # expert-parallel workers, if any


def _bench(cfg: ThroughputBenchConfig, engines: dict, env: dict, t0: float) -> dict:
    from specmoe.bench.roofline import PROBE_BYTES, measure_peak_flops, measure_read_bandwidth
    from specmoe.kernels import panel_prefetch
    from specmoe.utils.gc_heap import frozen_heap
    max_model_len = engines["plain"].max_model_len
    longest = cfg.output_len_range[1]
    prompts, skipped = fitting_prompts(build_prompts(cfg, engines["plain"]), longest,
                                       max_model_len)
    if not prompts:
        spread = "" if longest == cfg.max_tokens else f" (up to {longest} with the range ratio)"
        raise ValueError(f"all {len(skipped)} prompts are too long for max_model_len="
                         f"{max_model_len} with max_tokens={cfg.max_tokens}{spread}: lower "
                         "--max-tokens or choose shorter --datasets")
    assign_output_lengths(prompts, cfg)
    add_speculative_engines(cfg, engines, workload_kv_blocks(
        cfg, prompts, engines["plain"].config.scheduler.block_size))
    load_s = time.perf_counter() - t0  # models (and the prompts' tokenization)
    warm_up(engines, prompts)
    # the host's memory bandwidth drifts by tens of percent: C=1, bound by it, moves with
    # it while large C, bound by compute, does not, so the scaling ratios shift with it
    target = engines["plain"].target
    env["one_row_prefetch"] = panel_prefetch.state()  # set when the target loaded
    env["read_bandwidth_start"] = measure_read_bandwidth(PROBE_BYTES, repeats=3,
                                                         device=target.device)
    env["peak_flops"], env["peak_source"] = measure_peak_flops(target.loaded.dtype,
                                                               target.device)
    with frozen_heap():  # no 0.1-0.2 s collector pause inside a timed step
        runs = run_sweep(cfg, engines, prompts)
    env["read_bandwidth_end"] = measure_read_bandwidth(PROBE_BYTES, repeats=3,
                                                       device=target.device)
    env["load_average_end"] = os.getloadavg()[0]
    env["matmul_counts"] = add_floors(runs, target.arch, env["peak_flops"])
    rows = aggregate(runs)
    return {"config": dataclasses.asdict(cfg) | {"mode_order": "balanced"},
            "environment": env, "load_seconds": load_s,
            "max_model_len": max_model_len, "prompts": _prompt_rows(prompts),
            "skipped_prompts": _prompt_rows(skipped),
            "rows": rows, "ratios": ratios(runs),
            "target": target_line(runs, cfg.target_concurrency, cfg.target_ratio),
            "slowest_steps": slowest_steps(runs), "runs": runs,
            "total_seconds": time.perf_counter() - t0}


def _prompt_rows(prompts: list[dict]) -> list[dict]:
    return [{k: p[k] for k in ("dataset", "category", "max_tokens") if k in p}
            | {"num_tokens": len(p["token_ids"])} for p in prompts]


def num_failed_runs(results: dict) -> int:
    """Runs of `run_throughput_bench` results that raised."""
    return sum("error" in r for r in results["runs"])


def add_floors(runs: list[dict], arch: ArchConfig, peak_flops: float) -> dict:
    """Set "floor_seconds" on every successful run whose steps record their logit rows: the
    least time its matmuls take at peak_flops (`throughput_floor`). Returns the counts used
    (JSON-ready)."""
    counts = MatmulCounts.from_arch(arch)
    for r in runs:
        if "error" not in r and all(len(s) > 5 for s in r["steps"]):
            r["floor_seconds"] = run_floor_seconds(counts, peak_flops,
                                                   [(s[2], s[5]) for s in r["steps"]])
    return dataclasses.asdict(counts)
