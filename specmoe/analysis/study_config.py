"""What `specmoe study` runs (`StudyConfig`) and everything checked before it measures
anything (`plan_study`): a bad option fails in a second, not after minutes of timing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specmoe.analysis.cost_model import FEATURES, FIT_TOKENS
from specmoe.analysis.presets import EXPERT_WIDTH, PRESETS, TARGET_PRESETS, Preset
from specmoe.analysis.speedup import load_acceptance_lengths

ROUTINGS = ("correlated", "uniform", "router", "trace")
DTYPES = ("bfloat16", "float16", "float32")
# Adjacent-token expert overlap measured for k=8, N=128 in the analysis that
# docs/architecture.md summarises.
PUBLISHED_OVERLAP = 0.381


@dataclass
class StudyConfig:
    """What the study runs. Defaults take about 4 minutes on 2 CPU cores.

    Attributes:
        presets: target presets (see `presets.PRESETS`).
        batch_sizes: B values of the Tt grid.
        num_tokens: T values (tokens per request in one forward; T = K + 1); must include 1
            and a T >= 2.
        reps: repetitions of each grid point (min and median reported).
        context_len: tokens already in each request's KV cache, in tokens.
        routing: MoE routing of the synthetic presets: "correlated" (overlap `overlap`),
            "uniform" (independent), "router" (the random-weight router itself) or "trace"
            (windows of `routing_trace` replayed; MoE presets whose N and k differ from the
            trace's are replaced by one preset of the same size shaped like the trace).
        overlap: adjacent-token overlap of the correlated routing, in [0, 1].
        scale_layers: multiplies every preset's depth (bigger hardware).
        dtype, device: weights' dtype and the device (None: CUDA if present).
        acceptance_path: a `bench spec` results.json for AL(K) (None: the bundled figures of
            the real Qwen2.5-Coder pair).
        acceptance_group: its data-set group ("all", "humaneval", ...).
        acceptance: K -> AL given directly (instead of acceptance_path).
        draft_cost_ratio: Td/Tt per draft token given directly (None: measure the draft
            preset; 0: free drafts, as n-gram lookup nearly is).
        routing_model: a real MoE whose learned routing is captured on real prompts
            ("tiny-moe"; None: skip).
        routing_trace: analyse this routing-trace JSONL instead of capturing one (and, with
            routing "trace", replay it on the MoE presets).
        num_routing_prompts, routing_max_tokens: prompts and tokens of the capture.
        e2e_model, e2e_draft: a real MoE target and draft run end to end to compare
            predicted and measured speedup (`e2e_check`; e2e_model None: skip).
        e2e_batch_sizes, e2e_k: its batch sizes and K.
        seed: seeds weights, token ids and routing draws (>= 0).
    """

    presets: list[str] = field(default_factory=lambda: list(TARGET_PRESETS))
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    num_tokens: list[int] = field(default_factory=lambda: list(range(1, 9)))
    reps: int = 3
    context_len: int = 512
    routing: str = "correlated"
    overlap: float = PUBLISHED_OVERLAP
    scale_layers: float = 1.0
    dtype: str = "bfloat16"
    device: str | None = None
    acceptance_path: str | None = None
    acceptance_group: str = "all"
    acceptance: dict[int, float] | None = None
    draft_cost_ratio: float | None = None
    routing_model: str | None = "tiny-moe"
    routing_trace: str | None = None
    num_routing_prompts: int = 8
    routing_max_tokens: int = 48
    e2e_model: str | None = "tiny-moe"
    e2e_draft: str = "tiny-moe-draft"
    e2e_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    e2e_k: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_grid()
        self._check_numbers()
        if self.acceptance is not None and self.acceptance_path:
            raise ValueError("give acceptance lengths directly or acceptance_path "
                             f"({self.acceptance_path}), not both")
        if self.acceptance is not None and not self.acceptance:
            raise ValueError("acceptance is empty: give at least one K=AL pair")

    def _check_choices(self) -> None:
        unknown = [p for p in self.presets if p not in PRESETS or PRESETS[p].role != "target"]
        if unknown or not self.presets:
            raise ValueError(f"invalid presets {unknown or self.presets}: choose from "
                             f"{TARGET_PRESETS}")
        if len(set(self.presets)) != len(self.presets):
            raise ValueError(f"presets {self.presets} repeat a name")
        if self.routing not in ROUTINGS:
            raise ValueError(f"invalid routing={self.routing!r}: choose one of {ROUTINGS}")
        if self.routing == "trace" and not self.routing_trace:
            raise ValueError("routing='trace' needs routing_trace (a routing-trace JSONL)")
        if self.dtype not in DTYPES:
            raise ValueError(f"invalid dtype={self.dtype!r}: choose one of {DTYPES}")

    def _check_grid(self) -> None:
        for name in ("batch_sizes", "num_tokens", "e2e_batch_sizes"):
            values = getattr(self, name)
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise ValueError(f"invalid {name}={values}: ascending distinct ints >= 1")
        if 1 not in self.num_tokens or max(self.num_tokens) < 2:
            raise ValueError(f"invalid num_tokens={self.num_tokens}: must include 1 (the "
                             "baseline) and a T >= 2 (a verification)")
        fit_points = len(self.presets) * len(self.batch_sizes) \
            * len(set(FIT_TOKENS) & set(self.num_tokens))
        if fit_points < len(FEATURES):
            raise ValueError(f"{len(self.presets)} presets x {len(self.batch_sizes)} batch "
                             f"sizes x T in {list(FIT_TOKENS)} give {fit_points} points to "
                             f"fit the cost model's {len(FEATURES)} coefficients: need at "
                             f"least {len(FEATURES)}")

    def _check_numbers(self) -> None:
        checks = {"reps": self.reps >= 1, "context_len": self.context_len >= 0,
                  "scale_layers": 0 < self.scale_layers < math.inf,
                  "overlap": 0.0 <= self.overlap <= 1.0, "seed": self.seed >= 0,
                  "e2e_k": self.e2e_k >= 1,
                  "num_routing_prompts": self.num_routing_prompts >= 1,
                  "routing_max_tokens": self.routing_max_tokens >= 1,
                  "draft_cost_ratio": self.draft_cost_ratio is None
                  or 0.0 <= self.draft_cost_ratio < math.inf}
        rules = {"reps": ">= 1", "context_len": ">= 0", "scale_layers": "> 0",
                 "overlap": "in [0, 1]", "seed": ">= 0", "e2e_k": ">= 1",
                 "num_routing_prompts": ">= 1", "routing_max_tokens": ">= 1",
                 "draft_cost_ratio": ">= 0 and finite"}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: must be "
                                 f"{rules[name]}")


@dataclass
class StudyPlan:
    """What a checked configuration resolves to, before anything is timed.

    Attributes:
        presets: the target presets to build (depth scaled; trace-shaped if so).
        device: the torch device name.
        acceptance: K -> AL(K) for the K the grid can verify (K + 1 in num_tokens).
        acceptance_source: where AL came from, in words.
        trace: the routing trace to replay or analyse (a `RoutingTrace`), or None.
        warnings: things the user should know (printed, and in the report).
    """

    presets: list[Preset]
    device: str
    acceptance: dict[int, float]
    acceptance_source: str
    trace: object | None
    warnings: list[str]


def plan_study(cfg: StudyConfig) -> StudyPlan:
    """Check everything that can be checked without measuring.

    Raises:
        ValueError: an unusable device, acceptance lengths that cover no K of the grid, a bad
            trace or one too short for the largest T.
        FileNotFoundError: a missing trace or acceptance file, model or prompt set.
    """
    device = check_device(cfg.device)
    check_inputs(cfg)
    acceptance, source = acceptance_for(cfg)
    trace = None
    if cfg.routing_trace:
        from specmoe.analysis.routing_trace import read_trace
        trace = read_trace(cfg.routing_trace)
    presets = [PRESETS[n].scaled(cfg.scale_layers) for n in cfg.presets]
    warnings = _option_warnings(cfg, device)
    if cfg.routing == "trace":
        presets, note = _trace_presets(presets, trace, cfg)
        warnings += note
    return StudyPlan(presets, device, acceptance, source, trace, warnings)


def check_inputs(cfg: StudyConfig) -> None:
    """The real models and the prompt sets the learned-routing capture and the end-to-end
    check will read exist.

    Raises:
        FileNotFoundError: naming the missing model (and how to install it) or prompt set.
    """
    from specmoe.loader.aliases import resolve_model_path
    from specmoe.utils.data import load_prompts
    models = [cfg.routing_model] + ([cfg.e2e_model, cfg.e2e_draft] if cfg.e2e_model else [])
    for model in filter(None, models):
        resolve_model_path(model)
    if cfg.routing_model or cfg.e2e_model:
        for dataset in ("spec_bench", "mt_bench"):
            load_prompts(dataset, limit=1)


def check_device(device: str | None) -> str:
    """The device to run on (None: CUDA if present, else CPU).

    Raises:
        ValueError: an unknown device name, or CUDA asked for where there is none.
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"invalid device={device!r}: use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but torch sees no CUDA device here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"invalid device={device!r}: use cpu, cuda or cuda:N")
    return device


def acceptance_for(cfg: StudyConfig) -> tuple[dict[int, float], str]:
    """AL(K) for the K the grid can verify, and a line saying where it came from.

    Raises:
        ValueError: no AL(K) with K + 1 in num_tokens.
    """
    if cfg.acceptance:
        al, where = dict(cfg.acceptance), "given on the command line"
    else:
        al = load_acceptance_lengths(cfg.acceptance_path, group=cfg.acceptance_group)
        where = (cfg.acceptance_path or "bundled: specmoe bench spec, Qwen2.5-Coder 0.5B "
                 "(int4) -> 1.5B (bf16), greedy, 2 prompts x 64 tokens per data set")
        where += f" (group {cfg.acceptance_group}, draft-model proposer)"
    usable = {k: v for k, v in al.items() if k + 1 in cfg.num_tokens}
    if not usable:
        raise ValueError(f"acceptance lengths for K={sorted(al)} but num_tokens="
                         f"{cfg.num_tokens} measures no T = K + 1 for any of them")
    return usable, where


def _option_warnings(cfg: StudyConfig, device: str) -> list[str]:
    out = []
    if cfg.routing != "correlated" and cfg.overlap != PUBLISHED_OVERLAP:
        out.append(f"overlap={cfg.overlap} is used only by routing 'correlated', not "
                   f"{cfg.routing!r}")
    if cfg.dtype == "float16" and device == "cpu":
        out.append("float16 on CPU has no fast matmul path: timings will be slow and "
                   "unrepresentative (use bfloat16)")
    if cfg.routing == "trace" and not any(PRESETS[n].is_moe for n in cfg.presets):
        out.append("routing 'trace' has no MoE preset to replay on: only dense presets given")
    return out


def trace_preset(num_experts: int, top_k: int, num_layers: int) -> Preset:
    """An MoE preset of the standard total size, with a trace's N and k."""
    width = max(1, round(EXPERT_WIDTH / num_experts))
    return Preset(f"moe-{num_experts}x{top_k}", f"MoE shaped like the replayed trace: "
                  f"N={num_experts}, k={top_k}", num_experts, top_k, width, num_layers)


def _trace_presets(presets: list[Preset], trace, cfg: StudyConfig
                   ) -> tuple[list[Preset], list[str]]:
    """MoE presets whose N, k differ from the trace's become one trace-shaped preset.

    Raises:
        ValueError: the trace has no run of max(num_tokens) consecutive tokens.
    """
    from specmoe.analysis.routing_gen import TraceRouting
    TraceRouting.from_trace(trace).check_length(max(cfg.num_tokens), cfg.routing_trace)
    shape = (trace.num_experts, trace.top_k)
    keep = [p for p in presets if not p.is_moe or (p.num_experts, p.top_k) == shape]
    replaced = [p.name for p in presets if p not in keep]
    notes = []
    if replaced or not any(p.is_moe for p in keep):
        layers = next((p.num_moe_layers for p in presets if p.is_moe),
                      presets[0].num_layers)
        extra = trace_preset(*shape, layers)
        keep.insert(0, extra)
        if replaced:
            notes.append(f"trace N={shape[0]}, k={shape[1]}: presets {replaced} replaced by "
                         f"{extra.name} (same total size)")
    if len(trace.moe_layers) < max(p.num_moe_layers for p in keep):
        notes.append(f"the trace has {len(trace.moe_layers)} MoE layers: MoE layer i "
                     f"replays traced layer i mod {len(trace.moe_layers)}")
    return keep, notes


def prepare_out_dir(path: str | Path) -> Path:
    """Create the report directory (and its parents).

    Raises:
        ValueError: the path is a file, or cannot be created.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create the directory ({exc.strerror})") from exc
    return out
