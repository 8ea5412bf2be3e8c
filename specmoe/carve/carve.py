"""`specmoe models carve`: a dense Llama/Qwen2 checkpoint -> a Qwen2-MoE checkpoint that
specmoe and transformers both load.

Layer by layer, on calibration windows of the in-repo corpus: the carved model's own hidden
states go through the (unchanged) attention of layer l; on those FFN inputs the dense FFN's
neurons are grouped into experts (`cluster`), the router is fitted and the MoE layer trained
to reproduce the dense FFN's output (`moe_layer`, `train`); the carved layer's output then
feeds layer l + 1, so later layers learn on (and correct for) the errors of earlier ones.
Each finished layer is saved under `OUT/.carve/`, so a stopped carve resumes where it was.
Seeded: the same settings, source and corpus give the same bits on the same machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specmoe.carve import calibration, dense, evaluate
from specmoe.carve.cluster import group_neurons, neuron_energy
from specmoe.carve.moe_layer import CarvedMoE, expert_energy, fit_router
from specmoe.carve.train import TrainSettings, relative_error, train_layer
from specmoe.carve.writer import write_checkpoint


@dataclass(frozen=True)
class CarveSettings:
    """What to carve and how.

    Attributes:
        num_experts: routed experts per layer (N).
        top_k: routed experts per token (k).
        shared_experts: always-on experts of the same width, merged into one shared expert (S).
        layers: indices of the layers to carve (None: all); the others stay dense.
        calibration_windows: windows of `window` tokens the layers are fitted on.
        cluster_tokens: tokens (of those) the neuron clustering looks at.
        cluster_iterations: balanced k-means iterations.
        train: the reconstruction training.
        seed: for windows, clustering and training batches.
        dtype: the written checkpoint's dtype ("bfloat16" or "float32").
    """

    num_experts: int
    top_k: int
    shared_experts: int = 0
    layers: tuple[int, ...] | None = None
    calibration_windows: int = 64
    window: int = calibration.DEFAULT_WINDOW
    cluster_tokens: int = 4096
    cluster_iterations: int = 10
    train: TrainSettings = field(default_factory=TrainSettings)
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name, least in (("num_experts", 2), ("calibration_windows", 1), ("window", 2),
                            ("cluster_tokens", 1), ("cluster_iterations", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"invalid {name}={getattr(self, name)}: must be >= {least}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.shared_experts < 0:
            raise ValueError(f"shared_experts={self.shared_experts} must be >= 0")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype={self.dtype!r} must be 'bfloat16' or 'float32'")

    @property
    def active_fraction(self) -> float:
        """The FFN's share that runs per token: (S + k) / (S + N)."""
        return (self.shared_experts + self.top_k) / (self.shared_experts + self.num_experts)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class LayerReport:
    layer: int
    error_before: float   # relative squared error of the initial carve on calibration
    error_after: float    # after reconstruction training
    seconds: float


def carve(source: str, out_dir: str | Path, settings: CarveSettings,
          corpus_dir: str | Path | None = None, progress: bool = True,
          eval_windows_per_file: int = 0) -> list[LayerReport]:
    """Carve `source` (alias, HF directory or GGUF file) into an HF directory `out_dir`,
    then (eval_windows_per_file > 0) measure held-out perplexity per corpus file, dense
    against carved (`evaluate.quality`, float32, on that many windows of each file's
    held-out part).

    Returns:
        One report per carved layer (also in `out_dir/carve.json`, with the quality).
    Raises:
        ValueError: an architecture or shape that cannot be carved, a layer index out of
            range, `out_dir` naming a file or holding a carve with other settings that has
            finished a layer, a negative `eval_windows_per_file`; all found from the config
            before the model is read.
        FileNotFoundError: no such model or corpus.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: carve writes a model directory")
    if eval_windows_per_file < 0:
        raise ValueError(f"invalid eval windows per file={eval_windows_per_file}: must be "
                         ">= 0 (0: none)")
    layers = _carved_layers(settings, dense.read_dense_config(source)[1])
    corpus = calibration.split_corpus(Path(corpus_dir) if corpus_dir
                                      else calibration.default_corpus_dir())
    ckpt = dense.load_dense(source)
    state = out / ".carve"
    _claim(state, source, settings)
    tok = ckpt.tokenizer()
    ids = calibration.windows(tok, corpus.train, settings.calibration_windows, settings.window,
                              settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    reports, carved = [], {}
    with _Progress(progress) as bar, torch.no_grad():
        task = bar.add(f"carving {ckpt.num_layers} layers", ckpt.num_layers)
        rope = dense.rotary(ckpt.config, settings.window)
        h = dense.embed(ckpt, ids)
        for index in range(ckpt.num_layers):
            w = ckpt.layer(index)
            h = dense.attention_block(ckpt.config, w, h, rope)
            x = dense.ffn_input(ckpt.config, w, h).reshape(-1, h.shape[-1])
            if index in layers:
                layer, report = _carve_layer(ckpt, index, w, x, settings, gen, state, bar)
                carved[index] = layer
                reports.append(report)
                bar.note(f"layer {index}: relative error {report.error_before:.4f} -> "
                         f"{report.error_after:.4f} ({report.seconds:.1f} s)")
                ffn = layer(x)
            else:
                ffn = dense.dense_ffn(w, x)
            h = h + ffn.view(h.shape)
            bar.advance(task, 1)
    write_checkpoint(ckpt, carved, settings, out, tok)
    summary = {"source": source, "settings": settings.to_json(),
               "layers": [dataclasses.asdict(r) for r in reports]}
    if eval_windows_per_file:
        summary["quality"] = held_out_quality(ckpt, carved, tok, corpus.held_out,
                                              eval_windows_per_file, settings.window)
        bar.note(json.dumps(summary["quality"]["all"]))
    (out / "carve.json").write_text(json.dumps(summary, indent=1) + "\n")
    return reports


def held_out_quality(ckpt, carved: dict, tok, held_out: dict[str, str], per_file: int,
                     window: int) -> dict[str, dict]:
    """Per corpus file and over all ("all"): dense and carved perplexity, argmax agreement
    and tokens, on `per_file` held-out windows of each file."""
    out = {}
    for name, ids in calibration.per_file_windows(tok, held_out, per_file, window).items():
        d, c = evaluate.quality(ckpt, ids, carved)
        out[name] = {"dense_perplexity": d.perplexity, "carved_perplexity": c.perplexity,
                     "argmax_agreement": c.argmax_agreement, "tokens": c.tokens}
    tokens = sum(q["tokens"] for q in out.values())

    def pooled(key: str) -> float:  # exp of the token-weighted mean NLL
        return math.exp(sum(math.log(q[key]) * q["tokens"] for q in out.values()) / tokens)

    out["all"] = {"dense_perplexity": pooled("dense_perplexity"),
                  "carved_perplexity": pooled("carved_perplexity"),
                  "argmax_agreement": sum(q["argmax_agreement"] * q["tokens"]
                                          for q in out.values()) / tokens,
                  "tokens": tokens}
    return out


def _carved_layers(settings: CarveSettings, config: dict) -> set[int]:
    """The layers to carve, checked against the dense model's `config`: in range, and an
    FFN width that splits into S + N experts of one width."""
    n, width = int(config["num_hidden_layers"]), int(config["intermediate_size"])
    layers = set(range(n)) if settings.layers is None else set(settings.layers)
    bad = sorted(i for i in layers if not 0 <= i < n)
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has {n} layers")
    total = settings.num_experts + settings.shared_experts
    if width % total:
        raise ValueError(f"cannot carve intermediate size {width} into {total} experts "
                         f"({settings.shared_experts} shared + {settings.num_experts} routed): "
                         f"S + N must divide it (e.g. one of {_divisors(width)})")
    return layers


def _divisors(n: int, limit: int = 12) -> list[int]:
    return [d for d in range(2, min(n, 4096) + 1) if n % d == 0][:limit]


def _claim(state: Path, source: str, settings: CarveSettings) -> None:
    """Start or resume a carve in `state`; refuse one with other settings once it has
    finished a layer (a claim with none is taken over)."""
    state.mkdir(parents=True, exist_ok=True)
    meta = state / "settings.json"
    mine = {"source": source, "settings": settings.to_json()}
    if meta.exists() and any(state.glob("layer_*.safetensors")):
        theirs = json.loads(meta.read_text())
        if theirs != mine:
            raise ValueError(f"{state.parent} holds a carve with other settings ({theirs}); "
                             "choose another --out or delete it")
    else:
        meta.write_text(json.dumps(mine, indent=1) + "\n")


def _carve_layer(ckpt, index: int, w: dict, x: torch.Tensor, s: CarveSettings,
                 gen: torch.Generator, state: Path, bar) -> tuple[CarvedMoE, LayerReport]:
    """Carve and train layer `index` on FFN inputs x [T, H], or load it if already done."""
    path = state / f"layer_{index:03d}.safetensors"
    prefix = f"model.layers.{index}.mlp."
    if path.exists():
        saved = load_file(str(path))
        layer = CarvedMoE.from_hf_tensors(saved, prefix, s.num_experts, s.top_k)
        report = LayerReport(**json.loads((state / f"layer_{index:03d}.json").read_text()))
        # the generator must be where the finished layer left it, for the next layer's bits
        gen.set_state(saved["__generator_state__"].to(torch.uint8))
        return layer, report
    start = time.perf_counter()
    act = dense.ffn_activations(w, x)
    w_down = w["mlp.down_proj.weight"]
    target = act @ w_down.T
    sub = torch.randperm(x.shape[0], generator=gen)[:s.cluster_tokens]
    shared, routed = group_neurons(neuron_energy(act[sub], w_down), s.num_experts,
                                   s.shared_experts, s.active_fraction, s.cluster_iterations,
                                   gen)
    if s.top_k < s.num_experts:
        router = fit_router(x, expert_energy(act, w_down, routed))
    else:  # every expert runs: nothing to choose, and equal weights make the carve exact
        router = torch.zeros(s.num_experts, x.shape[1])
    del act
    layer = CarvedMoE(w, shared, routed, s.top_k, router)
    task = bar.add(f"layer {index}: training", s.train.steps)
    with torch.enable_grad():
        before, after = train_layer(layer, x, target, s.train, gen,
                                    lambda n: bar.advance(task, n))
    bar.remove(task)
    report = LayerReport(index, before, after, time.perf_counter() - start)
    tensors = layer.hf_tensors(prefix)
    tensors["__generator_state__"] = gen.get_state().clone()
    save_file(tensors, str(path))
    (state / f"layer_{index:03d}.json").write_text(json.dumps(dataclasses.asdict(report)))
    return layer, report


class _Progress:
    """rich progress bars, or nothing (progress=False)."""

    def __init__(self, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn())

    def __enter__(self) -> "_Progress":
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def add(self, description: str, total: int):
        return None if self._bar is None else self._bar.add_task(description, total=total)

    def advance(self, task, amount: int) -> None:
        if self._bar is not None:
            self._bar.advance(task, amount)

    def note(self, text: str) -> None:
        """A line above the bars, or on stderr without them (logs of long carves)."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def remove(self, task) -> None:
        if self._bar is not None:
            self._bar.remove_task(task)


__all__ = ["CarveSettings", "LayerReport", "carve", "relative_error"]
