"""Measure the tiny fixture models and write their model card (specmoe/models_data/MODEL_CARD.md).

Everything runs through our engine in float32 on held-out text (the validation tail of every
corpus file, split exactly as `tools/train_tiny_moe.py` split it):

- validation loss and perplexity of `tiny-moe` and `tiny-moe-draft`, per domain and overall
  (next-token cross-entropy over consecutive windows of max_position_embeddings tokens);
- expert load per MoE layer (tokens routed to each expert: max/mean, min/mean, coefficient of
  variation), recorded with `ExpertStatsRecorder`;
- adjacent-token expert overlap, mean |E_t ∩ E_t+1| / k, against the uniform baseline k/N and
  the popularity-weighted baseline sum_e p_e^2 / k (p_e = share of tokens routed to expert e);
- unique experts in windows of W = 1..8 consecutive tokens, against the uniform independence
  baseline N (1 - (1 - k/N)^W) and the popularity-weighted one sum_e 1 - (1 - p_e)^W;
- speculative acceptance length (Leviathan et al. 2023, arXiv 2211.17192: 1 + accepted drafts
  per verification) of the draft model for K = 1..6 and of n-gram prompt lookup, greedy, from
  `RequestOutput.spec_stats`, with a check that every speculative output equals plain greedy.

    python tools/tiny_moe_card.py            # prints the figures, writes the card and JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_moe import default_corpus_dir, split_corpus, val_windows  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.config import ModelConfig  # noqa: E402
from specmoe.layers.moe.backends import expert_stats  # noqa: E402
from specmoe.layers.moe.stats import ExpertStatsRecorder  # noqa: E402
from specmoe.loader.aliases import MODELS_DATA_DIR, resolve_model_path  # noqa: E402
from specmoe.loader.model_loader import load_model  # noqa: E402
from specmoe.outputs import SpecDecodeStats  # noqa: E402
from specmoe.worker.model_runner import ModelRunner  # noqa: E402

TARGET, DRAFT = "tiny-moe", "tiny-moe-draft"
MAX_WINDOW = 8


# ----------------------------------------------------------------------------- held-out text

def heldout_tokens(tokenizer, corpus_dir: Path, val_fraction: float) -> dict[str, list[int]]:
    """Domain (corpus file stem) -> token ids of its held-out tail."""
    split = split_corpus(corpus_dir, val_fraction)
    return {name: tokenizer.encode(text, add_special_tokens=False)
            for name, text in split.val.items()}


# ----------------------------------------------------------------------------- loss, routing

@dataclass
class EvalResult:
    """Summed cross-entropy (nats) and token count per domain, and the routing of every
    window: layer -> list of [T, k] expert ids."""

    nll: dict[str, float]
    num_tokens: dict[str, int]
    routing: dict[int, list[torch.Tensor]]

    def loss(self, domain: str | None = None) -> float:
        """Mean next-token cross-entropy in nats (all domains when None)."""
        if domain is not None:
            return self.nll[domain] / self.num_tokens[domain]
        return sum(self.nll.values()) / sum(self.num_tokens.values())


@torch.no_grad()
def evaluate(alias: str, heldout: dict[str, list[int]], max_windows: int | None) -> EvalResult:
    """Cross-entropy of `alias` (fp32, our runner) on held-out windows, recording routing."""
    loaded = load_model(ModelConfig(alias, dtype="float32", device="cpu"))
    runner, recorder = ModelRunner(loaded), ExpertStatsRecorder()
    expert_stats(loaded.model).subscribe(recorder)
    length = loaded.max_model_len
    result = EvalResult({}, {}, recorder.routing)
    for domain, ids in heldout.items():
        result.nll[domain], result.num_tokens[domain] = 0.0, 0
        for win in val_windows(torch.tensor(ids), length, max_windows).tolist():
            logits = runner.forward(runner.new_cache(length), win[:-1])  # [T, vocab_size]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(win[1:]),
                                                     reduction="sum")
            result.nll[domain] += loss.item()
            result.num_tokens[domain] += len(win) - 1
    return result


def expert_load(routing: list[torch.Tensor], num_experts: int) -> dict:
    """Load balance of one layer from its [T, k] expert ids (all windows)."""
    counts = torch.bincount(torch.cat(routing).flatten(), minlength=num_experts).double()
    mean = counts.mean()
    return {"max_over_mean": (counts.max() / mean).item(),
            "min_over_mean": (counts.min() / mean).item(),
            "cv": (counts.std(unbiased=False) / mean).item(),
            "num_unused": int((counts == 0).sum())}


def popularity(routing: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """p_e: share of tokens that route to expert e, [num_experts] float64 (sums to k)."""
    ids = torch.cat(routing)  # [num_tokens, k]
    return torch.bincount(ids.flatten(), minlength=num_experts).double() / ids.shape[0]


def membership(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] expert ids -> [T, num_experts] bool, True where the token routes to the expert."""
    mask = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool)
    return mask.scatter_(1, ids, True)


def adjacent_overlap(routing: list[torch.Tensor], num_experts: int, top_k: int) -> float:
    """Mean |E_t ∩ E_t+1| / k over adjacent token pairs inside each window."""
    shared, pairs = 0, 0
    for ids in routing:
        mask = membership(ids, num_experts)
        shared += int((mask[1:] & mask[:-1]).sum())
        pairs += mask.shape[0] - 1
    return shared / pairs / top_k


def unique_experts(routing: list[torch.Tensor], num_experts: int, window: int) -> float:
    """Mean number of distinct experts over every run of `window` consecutive tokens."""
    total, count = 0.0, 0
    for ids in routing:
        mask = membership(ids, num_experts).int()  # [T, N]
        if mask.shape[0] < window:
            continue
        csum = torch.cat([torch.zeros(1, num_experts, dtype=torch.int), mask.cumsum(0)])
        in_window = csum[window:] - csum[:-window]  # [T - W + 1, N] tokens per expert
        total += float((in_window > 0).sum(dim=1).double().sum())
        count += in_window.shape[0]
    return total / count


def routing_figures(routing: dict[int, list[torch.Tensor]], num_experts: int,
                    top_k: int) -> dict:
    """Per-layer load, overlap and unique experts with both baselines, and their means."""
    layers = {}
    for layer, rows in sorted(routing.items()):
        p = popularity(rows, num_experts)
        layers[layer] = {
            "load": expert_load(rows, num_experts),
            "overlap": adjacent_overlap(rows, num_experts, top_k),
            "overlap_popularity": float((p * p).sum()) / top_k,
            "unique": {w: unique_experts(rows, num_experts, w)
                       for w in range(1, MAX_WINDOW + 1)},
            "unique_popularity": {w: float((1 - (1 - p) ** w).sum())
                                  for w in range(1, MAX_WINDOW + 1)},
        }
    return {"layers": layers, "overlap_uniform": top_k / num_experts,
            "unique_uniform": {w: num_experts * (1 - (1 - top_k / num_experts) ** w)
                               for w in range(1, MAX_WINDOW + 1)}}


# ----------------------------------------------------------------------------- acceptance

def prompts_from(heldout: dict[str, list[int]], per_domain: int, prompt_len: int,
                 ) -> list[list[int]]:
    """`per_domain` prompts of `prompt_len` tokens per domain, evenly spaced in its text."""
    prompts = []
    for ids in heldout.values():
        stride = max(1, (len(ids) - prompt_len) // per_domain)
        prompts += [ids[i * stride:i * stride + prompt_len] for i in range(per_domain)]
    return prompts


def acceptance(prompts: list[list[int]], max_tokens: int, ks: list[int]) -> dict:
    """Greedy acceptance length of the draft model (each K) and n-gram lookup (each K), and
    whether every speculative output equals the plain greedy output."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(TARGET, dtype="float32", device="cpu", seed=0)
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    results = {}
    for method in ("draft", "ngram"):
        for k in ks:
            spec = {"method": method, "num_speculative_tokens": k}
            if method == "draft":
                spec["draft_model"] = DRAFT
            start = time.perf_counter()
            outs = llm.with_speculative(spec).generate(prompts, params)
            stats = SpecDecodeStats()
            for out in outs:
                stats.merge(out.spec_stats)
            results[f"{method}/{k}"] = {
                "mean_acceptance_length": stats.mean_acceptance_length,
                "acceptance_rate": stats.acceptance_rate,
                "acceptance_per_position": stats.acceptance_per_position(),
                "num_drafts": stats.num_drafts,
                "identical_to_plain": [o.token_ids for o in outs] == plain,
                "wall_s": time.perf_counter() - start}
    return results


# ----------------------------------------------------------------------------- model facts

def model_facts(alias: str) -> dict:
    """Architecture, shapes, parameter counts, file size and training log of a bundled model."""
    path = resolve_model_path(alias)
    cfg = json.loads((path / "config.json").read_text())
    log = json.loads((path / "train_log.json").read_text())
    weights = path / "model.safetensors"
    facts = {"architecture": cfg["architectures"][0], "config": cfg,
             "num_params": log["num_params"], "file_bytes": weights.stat().st_size,
             "train_wall_s": log["wall_time_s"], "train_config": log["train_config"],
             "num_train_tokens": log["num_train_tokens"], "val_loss_curve": log["val_loss"],
             "final_train_loss": sum(log["step_loss"][-20:]) / len(log["step_loss"][-20:]),
             "threads": log["threads"], "data_prep_s": log["args"].get("data_prep_s")}
    if "num_experts" in cfg:
        facts["num_active_params"] = active_params(cfg, log["num_params"])
    return facts


def active_params(cfg: dict, num_params: int) -> int:
    """Parameters a token uses: all but the (N - k) unused experts of every layer."""
    per_expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"]
    unused = cfg["num_experts"] - cfg["num_experts_per_tok"]
    return num_params - cfg["num_hidden_layers"] * unused * per_expert


# ----------------------------------------------------------------------------- rendering

def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_models(facts: dict[str, dict]) -> str:
    rows = []
    for alias, f in facts.items():
        c = f["config"]
        moe = (f"{c['num_experts']} routed experts, top-{c['num_experts_per_tok']}, expert "
               f"width {c['intermediate_size']}" if "num_experts" in c
               else f"dense MLP width {c['intermediate_size']}")
        active = f"{f['num_active_params']:,}" if "num_active_params" in f else "all"
        rows.append([f"`{alias}`", f["architecture"], c["num_hidden_layers"], c["hidden_size"],
                     f"{c['num_attention_heads']} x {c['hidden_size'] // c['num_attention_heads']}",
                     moe, f"{f['num_params']:,}", active,
                     f"{f['file_bytes'] / 2**20:.1f} MiB"])
    return _table(["alias", "class", "layers", "hidden", "heads x dim", "MLP", "params",
                   "active/token", "weights (bf16)"], rows)


def render_training(facts: dict[str, dict]) -> str:
    rows = []
    for alias, f in facts.items():
        t = f["train_config"]
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in f["val_loss_curve"])
        rows.append([f"`{alias}`", t["steps"], f"{t['batch_size']} x {t['seq_len']}",
                     f"{t['steps'] * t['batch_size'] * t['seq_len'] / 1e6:.1f} M",
                     t["lr"], f"{f['final_train_loss']:.3f}", f["threads"],
                     f"{f['train_wall_s'] / 60:.1f} min", curve])
    return _table(["alias", "steps", "batch x seq", "tokens seen", "peak lr",
                   "train loss (last 20 steps)", "threads", "wall time",
                   "val loss during training (step: nats on the first 48 held-out windows)"],
                  rows)


def render_eval(evals: dict[str, EvalResult]) -> str:
    domains = list(next(iter(evals.values())).nll)
    rows = []
    for alias, ev in evals.items():
        cells = [f"{ev.loss(d):.3f} ({torch.tensor(ev.loss(d)).exp():.1f})" for d in domains]
        rows.append([f"`{alias}`", f"**{ev.loss():.3f} ({torch.tensor(ev.loss()).exp():.1f})**",
                     *cells])
    ev = next(iter(evals.values()))
    rows.append(["tokens", sum(ev.num_tokens.values()), *[ev.num_tokens[d] for d in domains]])
    return _table(["model", "all", *domains], rows)


def render_load(fig: dict) -> str:
    rows = [[layer, f"{r['load']['max_over_mean']:.2f}", f"{r['load']['min_over_mean']:.2f}",
             f"{r['load']['cv']:.3f}", r["load"]["num_unused"]]
            for layer, r in fig["layers"].items()]
    return _table(["layer", "max/mean", "min/mean", "CV", "unused experts"], rows)


def render_overlap(fig: dict) -> str:
    layers = fig["layers"]
    rows = [[layer, f"{r['overlap']:.3f}", f"{r['overlap_popularity']:.3f}",
             f"{fig['overlap_uniform']:.3f}"] for layer, r in layers.items()]
    mean = lambda key: sum(r[key] for r in layers.values()) / len(layers)  # noqa: E731
    rows.append(["mean", f"**{mean('overlap'):.3f}**", f"{mean('overlap_popularity'):.3f}",
                 f"{fig['overlap_uniform']:.3f}"])
    return _table(["layer", "measured", "popularity-weighted", "uniform k/N"], rows)


def render_unique(fig: dict) -> str:
    layers = fig["layers"].values()
    rows = []
    for w in range(1, MAX_WINDOW + 1):
        measured = sum(r["unique"][w] for r in layers) / len(layers)
        popular = sum(r["unique_popularity"][w] for r in layers) / len(layers)
        uniform = fig["unique_uniform"][w]
        rows.append([w, f"{measured:.2f}", f"{popular:.2f}", f"{uniform:.2f}",
                     f"{measured / uniform:.3f}"])
    return _table(["W", "measured (mean over layers)", "popularity-weighted",
                   "uniform N(1-(1-k/N)^W)", "measured / uniform"], rows)


def render_acceptance(acc: dict, ks: list[int]) -> str:
    rows = []
    for method in ("draft", "ngram"):
        row = [f"{method}"]
        for k in ks:
            r = acc[f"{method}/{k}"]
            row.append(f"{r['mean_acceptance_length']:.2f}")
        rows.append(row)
    identical = all(r["identical_to_plain"] for r in acc.values())
    table = _table(["proposer", *[f"K={k}" for k in ks]], rows)
    return table + f"\n\nEvery speculative output identical to plain greedy: **{identical}**."


CARD = """# tiny-moe and tiny-moe-draft: fixture models trained on real text

Generated by `tools/tiny_moe_card.py` (do not edit by hand; rerun it). The models are trained
by `tools/train_tiny_moe.py` (seed 0, CPU) and ship inside specmoe under the aliases
`tiny-moe` (target) and `tiny-moe-draft` (draft):

```python
from specmoe import LLM, SamplingParams
llm = LLM("tiny-moe", speculative={{"method": "draft", "draft_model": "tiny-moe-draft",
                                    "num_speculative_tokens": 4}})
```

What they are for: a Mixture-of-Experts target whose router was *learned* (experts that
specialise, adjacent tokens that share experts) and a real draft model for it, so routing
analysis, verification-cost measurements, demos and end-to-end tests run on a real MoE. They
are small base language models (no instruction tuning; the ChatML chat template exists only so
chat code paths run), trained for {total_min:.0f} minutes on 2 CPU cores: the text they write
is locally fluent and globally meaningless. Do not use them for anything but measurement and
testing.

## Data

`data/corpus/` of the repository (5 files, 7.4 MB): `arxiv`, `b3g` (books), `c4` (web),
`github_oss_with_stack` (source code), `wikipedia`. Source: allenai/OLMoE @ 357454f4,
`scripts/routing_output/text/*_texts.txt` (repository Apache-2.0; the samples come from public
corpora with their own terms). The last {val_pct:.0f}% of every file (cut at a line boundary) is
held out; everything below is measured on that held-out text. Training: {train_tokens:,}
tokens (random windows, each file followed by `<|endoftext|>`).

Tokenizer: byte-level BPE (`tokenizers`), {vocab_size} tokens including `<|endoftext|>` (id 0,
EOS and padding), `<|im_start|>`, `<|im_end|>`; trained on the training split only.

## Models

{models_table}

Both use RoPE (theta 10000), RMSNorm, SwiGLU, tied input/output embeddings and a context of
{context} tokens (the training window; `max_position_embeddings`). The target is
`transformers.OlmoeForCausalLM` (q/k RMSNorm, softmax router without renormalising the top-k
weights, every layer MoE), trained with the router load-balancing loss (coefficient
{aux_coef}); the draft is `transformers.LlamaForCausalLM`. Weights are stored in bfloat16
(`model.safetensors`); `train_log.json` beside them holds every step's loss.

## Training

{training_table}

AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), {warmup} warmup steps, cosine decay to
10% of the peak learning rate, gradient clipping at 1.0, bf16 autocast with fp32 master
weights. Each model was trained by its own process (`--only target`, `--only draft`) under
`nice -n 19` on a 2-core AMD EPYC VM (AVX-512 BF16) shared with other jobs, so the wall times
above are inflated by contention; data preparation (tokenizer training and encoding) took
{data_prep_s} s per process. Total: {total_min:.1f} minutes. Retrain (seeded; bitwise
reproducible with the same thread count and CPU; overwrites the directories):

```bash
python tools/train_tiny_moe.py --threads 1 --only draft
python tools/train_tiny_moe.py --threads 2 --only target
python tools/tiny_moe_card.py
```

## Validation loss and perplexity

Next-token cross-entropy in nats (perplexity in brackets), float32, our engine, on consecutive
{context}-token windows of the held-out text:

{eval_table}

## Expert load balance (held-out text, {num_routed:,} tokens per layer)

Tokens routed to each expert (each token counts for its k experts); max/mean and min/mean of
the per-expert counts and their coefficient of variation (std/mean; 0 is perfectly even):

{load_table}

The imbalance within a layer is expected: `transformers`' `load_balancing_loss_func` pools
the router outputs of all layers before computing the Switch loss, so it evens out each
expert index's load summed over the layers, not the load inside each layer (the loss stayed
at about 1.0 per layer, its balanced value, throughout training).

## Expert routing overlap between adjacent tokens

Mean |E_t ∩ E_t+1| / k over adjacent tokens (N = {num_experts}, k = {top_k}), against
independent tokens drawn uniformly (k/N) and independent tokens drawn with each expert's
measured popularity p_e (sum_e p_e^2 / k):

{overlap_table}

## Unique experts per verification window

Distinct experts over W consecutive tokens (the experts a verification window of W tokens
must read), mean over layers, against the independence baselines N(1-(1-k/N)^W) (uniform)
and sum_e 1-(1-p_e)^W (popularity-weighted):

{unique_table}

## Speculative decoding acceptance

Mean acceptance length (tokens emitted per verification step, 1 + accepted drafts / drafts;
`RequestOutput.spec_stats`) of `tiny-moe-draft` and of n-gram prompt lookup (n = 1..3) for
K = 1..{max_k}, greedy, float32, on {num_prompts} held-out prompts ({per_domain} per domain) of
{prompt_len} tokens, {max_tokens} new tokens each:

{acceptance_table}
"""


def render_card(facts: dict, evals: dict, fig: dict, acc: dict, num_prompts: int,
                args) -> str:
    """The model card (Markdown) from the measured figures."""
    target = facts[TARGET]
    cfg = target["config"]
    total_s = sum(f["train_wall_s"] for f in facts.values()) + float(target["data_prep_s"] or 0)
    num_routed = sum(r.shape[0] for r in evals[TARGET].routing[0])
    return CARD.format(
        total_min=total_s / 60, val_pct=args.val_fraction * 100,
        train_tokens=target["num_train_tokens"], vocab_size=cfg["vocab_size"],
        models_table=render_models(facts), context=cfg["max_position_embeddings"],
        aux_coef=cfg["router_aux_loss_coef"], training_table=render_training(facts),
        warmup=target["train_config"]["warmup_steps"],
        data_prep_s=target["data_prep_s"], eval_table=render_eval(evals),
        num_routed=num_routed, load_table=render_load(fig), num_experts=cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"], overlap_table=render_overlap(fig),
        unique_table=render_unique(fig), max_k=max(args.ks), num_prompts=num_prompts,
        per_domain=args.prompts_per_domain,
        prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        acceptance_table=render_acceptance(acc, args.ks))


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-dir", type=Path, default=None,
                   help="default: data/corpus/ of this repository")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="must equal the training run's (default: %(default)s)")
    p.add_argument("--max-windows", type=int, default=None,
                   help="held-out windows per domain for loss and routing (default: all)")
    p.add_argument("--prompts-per-domain", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")],
                   default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--card", type=Path, default=MODELS_DATA_DIR / "MODEL_CARD.md")
    p.add_argument("--json", type=Path, default=MODELS_DATA_DIR / "card_figures.json")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.corpus_dir = args.corpus_dir or default_corpus_dir()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm_tok = load_model(ModelConfig(TARGET, dtype="float32", device="cpu")).load_tokenizer()
    heldout = heldout_tokens(llm_tok, args.corpus_dir, args.val_fraction)
    facts = {alias: model_facts(alias) for alias in (TARGET, DRAFT)}
    evals = {alias: evaluate(alias, heldout, args.max_windows) for alias in (TARGET, DRAFT)}
    cfg = facts[TARGET]["config"]
    fig = routing_figures(evals[TARGET].routing, cfg["num_experts"],
                          cfg["num_experts_per_tok"])
    prompts = prompts_from(heldout, args.prompts_per_domain, args.prompt_len)
    acc = acceptance(prompts, args.max_tokens, args.ks)
    card = render_card(facts, evals, fig, acc, len(prompts), args)
    args.card.write_text(card)
    figures = {"val_loss": {a: {"all": e.loss(), **{d: e.loss(d) for d in e.nll}}
                            for a, e in evals.items()},
               "routing": fig, "acceptance": acc, "seconds": time.perf_counter() - start}
    args.json.write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print(card)
    print(f"wrote {args.card} and {args.json} in {figures['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
