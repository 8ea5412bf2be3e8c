"""`specmoe models card`: the model card of a carved MoE, every figure measured through the
engine (bf16, the same loader, kernels and KV cache as serving) against its dense original.

What it measures, on the same held-out corpus split the carve held out and on real prompts:
- held-out perplexity per corpus file, carved and dense, and how often their next-token argmax
  agree (teacher forcing on the held-out text);
- greedy agreement on the prompt sets: the carved model's argmax on the dense model's greedy
  continuation, and how many tokens the two greedy outputs share before they diverge;
- acceptance length of a draft model and of n-gram lookup at K = 1..K_max, against the carved
  and against the dense target. Greedy acceptance is a function of the target's greedy output
  alone: drafted token j is accepted when the proposer's token equals the target's, and while
  it does, the proposer's context is the target's own prefix. So one teacher-forced pass of the
  draft over each target output (and n-gram lookup on its prefixes) gives the accepted run at
  every position, and replaying draft-then-verify on those runs gives every K. One real
  speculative run per proposer at `check_k` checks the replay (and that it is lossless);
- routing of the carved model on the prompts (`analysis.routing_stats`): adjacent-token
  overlap, unique experts per window against both independence baselines, expert load.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specmoe.analysis.routing_capture import record_routing
from specmoe.analysis.routing_stats import analyze_routing
from specmoe.bench.spec import SPEC_BENCH_CATEGORIES, SpecBenchConfig, build_prompts
from specmoe.carve import calibration
from specmoe.sampling_params import SamplingParams
from specmoe.spec_decode.ngram import find_ngram_continuation


KV_CACHE_BYTES = 512 << 20


@dataclass
class CardConfig:
    """What to measure. Defaults take about 15 minutes for the 1.5B carve on 2 CPU cores.

    Attributes:
        model: the carved MoE (directory or alias).
        dense: its dense original (alias, HF directory or GGUF file).
        draft: the draft model whose acceptance is measured (besides n-gram).
        datasets / num_prompts / spec_bench_categories: the prompt sets (`bench spec`'s).
        max_tokens: greedy tokens generated per prompt.
        max_k: acceptance at K = 1..max_k.
        check_k: K of the real speculative runs that check the replay (0: none).
        eval_windows: held-out windows per corpus file; window: their length in tokens.
        corpus_dir: the corpus the carve used (None: the one in the package).
    """

    model: str
    dense: str
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    datasets: list[str] = field(default_factory=lambda: ["humaneval", "mt_bench", "gsm8k",
                                                         "spec_bench"])
    num_prompts: int = 2
    spec_bench_categories: list[str] = field(default_factory=lambda: list(
        SPEC_BENCH_CATEGORIES))
    max_tokens: int = 96
    max_k: int = 8
    check_k: int = 4
    eval_windows: int = 4
    window: int = calibration.DEFAULT_WINDOW
    corpus_dir: str | None = None
    prompt_lookup: tuple[int, int] = (1, 3)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_tokens", "max_k", "eval_windows", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.check_k <= self.max_k:
            raise ValueError(f"check_k={self.check_k} must be in [0, max_k={self.max_k}]")


def teacher_forced(runner, token_ids: list[int], first: int) -> tuple[torch.Tensor, float]:
    """One prefill of `token_ids` through `runner` (a `ModelRunner`) in a fresh KV cache.

    Returns:
        (argmax [len - first] int64 of the logits predicting token_ids[first:],
         summed NLL of those tokens in nats).
    Raises:
        ValueError: first not in [1, len(token_ids)).
    """
    if not 1 <= first < len(token_ids):
        raise ValueError(f"first={first} must be in [1, {len(token_ids)})")
    logits = runner.forward(runner.new_cache(len(token_ids)), token_ids)[first - 1:-1]
    target = torch.tensor(token_ids[first:])
    nll = float(F.cross_entropy(logits.float(), target, reduction="sum"))
    return logits.argmax(-1).cpu(), nll


def accepted_runs(matches: list[bool]) -> list[int]:
    """runs[i]: consecutive True from position i on (the tokens a proposer whose token at
    each position is right where matches is True gets accepted when drafting from i)."""
    runs, run = [0] * len(matches), 0
    for i in range(len(matches) - 1, -1, -1):
        run = run + 1 if matches[i] else 0
        runs[i] = run
    return runs


def replay(num_tokens: int, accepted_at, k: int) -> dict:
    """Greedy draft-then-verify over a target output of `num_tokens`, K = k, as the engine
    runs it: the prompt's forward gives output token 0 without drafting; each decode step
    then drafts min(k, tokens still to come - 1) and verifies them.

    Args:
        accepted_at: (pos, k) -> (proposed tokens, accepted of them) when drafting up to k
            tokens at output position pos.
    Returns:
        steps (decode-step target forwards), drafts (steps with a proposal), drafted and
        accepted tokens.
    """
    pos, steps, drafts, drafted, accepted = min(num_tokens, 1), 0, 0, 0, 0
    while pos < num_tokens:
        proposed, a = accepted_at(pos, min(k, num_tokens - pos - 1))
        steps += 1
        drafts += proposed > 0
        drafted += proposed
        accepted += a
        pos += a + 1
    return {"steps": steps, "drafts": drafts, "drafted": drafted, "accepted": accepted}


def draft_acceptor(draft_runner, prompt: list[int], output: list[int]):
    """`replay`'s accepted_at for a draft model: its teacher-forced argmax on the target's
    output (drafting is greedy, so its K tokens are its argmax along the accepted prefix)."""
    argmax, _ = teacher_forced(draft_runner, prompt + output, len(prompt))
    runs = accepted_runs((argmax == torch.tensor(output)).tolist())
    return lambda pos, k: (k, min(runs[pos], k))


def ngram_acceptor(prompt: list[int], output: list[int], lookup: tuple[int, int]):
    """`replay`'s accepted_at for n-gram lookup (`find_ngram_continuation`) on the prefix."""
    def accepted_at(pos: int, k: int) -> tuple[int, int]:
        proposal = find_ngram_continuation(prompt + output[:pos], *lookup, k)
        a = 0
        while a < len(proposal) and proposal[a] == output[pos + a]:
            a += 1
        return len(proposal), a
    return accepted_at


def acceptance_curve(acceptors: list, lengths: list[int], max_k: int) -> list[dict]:
    """Per K = 1..max_k, over all outputs: tokens per decode step (the first token comes from
    the prompt's forward) and 1 + accepted / drafts (`bench spec`'s mean acceptance length)."""
    out = []
    for k in range(1, max_k + 1):
        tot = {"steps": 0, "drafts": 0, "drafted": 0, "accepted": 0}
        for acc, n in zip(acceptors, lengths):
            for key, v in replay(n, acc, k).items():
                tot[key] += v
        decoded = sum(max(n - 1, 0) for n in lengths)
        out.append({"k": k, "tokens_per_step": decoded / max(tot["steps"], 1),
                    "mean_acceptance_length": 1 + tot["accepted"] / max(tot["drafts"], 1),
                    **tot})
    return out


def held_out(cfg: CardConfig, runners: dict, tokenizer) -> dict:
    """Per corpus file and pooled ("all"): perplexity of each runner (name -> ModelRunner)
    and the carved model's argmax agreement with the dense one."""
    corpus = calibration.split_corpus(Path(cfg.corpus_dir) if cfg.corpus_dir
                                      else calibration.default_corpus_dir())
    windows = calibration.per_file_windows(tokenizer, corpus.held_out, cfg.eval_windows,
                                           cfg.window)
    out, total = {}, {"tokens": 0, "agree": 0} | {f"{n}_nll": 0.0 for n in runners}
    for name, ids in windows.items():
        row = {"tokens": 0, "agree": 0} | {f"{n}_nll": 0.0 for n in runners}
        for window in ids.tolist():
            argmax = {}
            for n, runner in runners.items():
                argmax[n], nll = teacher_forced(runner, window, 1)
                row[f"{n}_nll"] += nll
            row["tokens"] += len(window) - 1
            row["agree"] += int((argmax["carved"] == argmax["dense"]).sum())
        out[name] = _quality(row, runners)
        for key in total:
            total[key] += row[key]
    out["all"] = _quality(total, runners)
    return out


def _quality(row: dict, runners: dict) -> dict:
    q = {f"{n}_perplexity": float(torch.tensor(row[f"{n}_nll"] / row["tokens"]).exp())
         for n in runners}
    return q | {"argmax_agreement": row["agree"] / row["tokens"], "tokens": row["tokens"]}


def greedy_agreement(carved_runner, prompts: list[list[int]], dense_out: list[list[int]],
                     carved_out: list[list[int]]) -> dict:
    """The carved model's argmax on the dense greedy continuation (teacher forcing), and the
    shared prefix of the two greedy outputs, both as a share of the dense tokens."""
    agree, common, tokens = 0, 0, 0
    for p, d, c in zip(prompts, dense_out, carved_out):
        argmax, _ = teacher_forced(carved_runner, p + d, len(p))
        agree += int((argmax == torch.tensor(d)).sum())
        common += next((i for i, (a, b) in enumerate(zip(d, c)) if a != b), min(len(d), len(c)))
        tokens += len(d)
    return {"teacher_forced_argmax_agreement": agree / tokens,
            "shared_prefix_fraction": common / tokens, "tokens": tokens}


def measure_card(cfg: CardConfig, progress=print) -> dict:
    """Everything in the module docstring, as one JSON-ready dict."""
    from specmoe import LLM
    t0 = time.perf_counter()
    # three models stay loaded: a KV cache for the prompts' few thousand tokens, not the
    # default 1 GiB each
    sched = {"kv_cache_memory_bytes": KV_CACHE_BYTES}
    dense = LLM(cfg.dense, dtype=cfg.dtype, scheduler=sched)
    carved = LLM(cfg.model, dtype=cfg.dtype, scheduler=sched)
    draft = LLM(cfg.draft, dtype=cfg.dtype, scheduler=sched)
    runners = {"dense": dense.target, "carved": carved.target}
    progress("held-out perplexity")
    card = {"config": dict(vars(cfg)),
            "carve": _carve_json(cfg.model),
            "held_out": held_out(cfg, runners, carved.tokenizer)}
    bench_cfg = SpecBenchConfig(datasets=cfg.datasets, num_prompts=cfg.num_prompts,
                                spec_bench_categories=cfg.spec_bench_categories)
    bench_prompts = build_prompts(bench_cfg, carved)
    prompts = [p.token_ids for p in bench_prompts]
    card["prompt_groups"] = [p.group for p in bench_prompts]
    sp = SamplingParams(temperature=0, max_tokens=cfg.max_tokens, ignore_eos=True)
    progress(f"greedy outputs of {len(prompts)} prompts, routing")
    outputs = {"dense": [o.token_ids for o in dense.generate(prompts, sp)]}
    carved_outputs, trace = record_routing(carved, prompts, sp)
    outputs["carved"] = [o.token_ids for o in carved_outputs]
    card["routing"] = analyze_routing(trace, 8, 8).to_json()
    card["greedy_agreement"] = greedy_agreement(carved.target, prompts, outputs["dense"],
                                                outputs["carved"])
    progress("acceptance")
    card["acceptance"] = {t: _acceptance(cfg, draft.target, prompts, outputs[t])
                          for t in ("carved", "dense")}
    if cfg.check_k:
        progress(f"speculative runs at K={cfg.check_k}")
        card["check"] = {t: _check(cfg, llm, prompts, sp, outputs[t])
                         for t, llm in (("carved", carved), ("dense", dense))}
    card["seconds"] = time.perf_counter() - t0
    return card


def _acceptance(cfg: CardConfig, draft_runner, prompts, outputs) -> dict:
    lengths = [len(o) for o in outputs]
    draft = [draft_acceptor(draft_runner, p, o) for p, o in zip(prompts, outputs)]
    ngram = [ngram_acceptor(p, o, cfg.prompt_lookup) for p, o in zip(prompts, outputs)]
    return {"draft": acceptance_curve(draft, lengths, cfg.max_k),
            "ngram": acceptance_curve(ngram, lengths, cfg.max_k)}


def _check(cfg: CardConfig, llm, prompts, sp: SamplingParams, plain: list[list[int]]
           ) -> dict:
    """Real greedy speculative runs (`sp`) at check_k: lossless against the plain outputs,
    and their measured 1 + accepted / drafts."""
    out = {}
    for method, extra in (("draft", {"draft_model": cfg.draft}),
                          ("ngram", {"prompt_lookup_min": cfg.prompt_lookup[0],
                                     "prompt_lookup_max": cfg.prompt_lookup[1]})):
        spec = llm.with_speculative({"method": method, "num_speculative_tokens": cfg.check_k,
                                     **extra})
        res = spec.generate(prompts, sp)
        drafts = sum(r.spec_stats.num_drafts for r in res)
        accepted = sum(r.spec_stats.num_accepted_tokens for r in res)
        out[method] = {"k": cfg.check_k, "lossless": [r.token_ids for r in res] == plain,
                       "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                       "drafts": drafts, "accepted": accepted}
    return out


def _carve_json(model: str) -> dict | None:
    from specmoe.loader.aliases import resolve_model_path
    path = resolve_model_path(model) / "carve.json"
    return json.loads(path.read_text()) if path.is_file() else None
