"""`specmoe demo`: plain vs speculative decoding on real prompts, for a dense target and a MoE
target, in one table.

Each pair loads once; one engine serves both modes (speculation is turned off per request
with K = 0). Before anything is timed, one plain and one speculative generation run on a
prompt outside the set, so first-call costs (kernel builds, weight packing, allocator
growth) are not counted as decoding. Then each prompt runs in both modes back to back,
the order alternating from prompt to prompt, so both see the same machine state. Greedy
decoding is lossless: the "same" column compares the token ids of the two runs. The prefix
cache is emptied before each timed run, so neither mode reuses the other's prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from specmoe.entrypoints.args import apply_threads, speculative_from_args
from specmoe.utils.data import one_per_category

DEMO_CATEGORIES = ["summarization", "rag", "coding", "math_reasoning", "translation",
                   "qa", "writing", "extraction"]
WARM_UP_PROMPT = "List the planets of the solar system in order from the Sun."


@dataclass
class DemoPair:
    """One target with its proposer: `chat` wraps prompts in the chat template (instruction
    models); base models continue the raw text."""

    label: str  # the pair, in full
    short: str  # the target, as the table names it
    model: str
    speculative: dict
    chat: bool


@dataclass
class DemoRow:
    label: str
    category: str
    plain: object  # RequestOutput
    plain_s: float
    spec: object
    spec_s: float


def demo_pairs(args) -> list[DemoPair]:
    """The dense pair (--model with --draft) and, unless --moe-model is "none", the MoE pair
    (--moe-model with the draft model --moe-draft)."""
    spec = speculative_from_args(args)
    if spec is None:
        raise ValueError("the demo compares against speculation: pass --draft ngram or a model")
    if getattr(args, "expert_parallel_size", 1) != 1:
        raise ValueError("the demo runs in one process (its dense pair has no experts): "
                         "--expert-parallel-size is for generate, serve and bench throughput")
    pairs = [DemoPair(f"{args.model} + {_proposer(spec)}", f"dense: {args.model}", args.model,
                      spec, chat=True)]
    if args.moe_model != "none":
        moe_spec = {"method": "draft", "draft_model": args.moe_draft,
                    "num_speculative_tokens": args.num_speculative_tokens}
        pairs.append(DemoPair(f"{args.moe_model} + {_proposer(moe_spec)}",
                              f"MoE: {args.moe_model}", args.moe_model, moe_spec, chat=False))
    return pairs


def _proposer(spec: dict) -> str:
    name = "n-gram" if spec["method"] == "ngram" else spec["draft_model"]
    return f"{name} K={spec['num_speculative_tokens']}"


def run_demo(args) -> None:
    from specmoe import SamplingParams
    console = Console()
    pairs = demo_pairs(args)
    prompts = one_per_category("spec_bench", DEMO_CATEGORIES)[:args.num_prompts]
    apply_threads(args)
    # K = None: the request drafts as many tokens as its engine's proposer was set up for.
    modes = {mode: SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  num_speculative_tokens=k)
             for mode, k in (("plain", 0), ("spec", None))}
    rows: list[DemoRow] = []
    for pair in pairs:
        llm = _load(console, pair, args)
        texts = [_prompt(llm, pair, p.text, args.max_tokens) for p in prompts]
        rows += _run_pair(console, llm, pair, texts, [p.category for p in prompts], modes,
                          args.max_tokens)
        del llm
    console.print(_table(rows, args, [p.label for p in pairs]))
    _print_sample(console, rows[0])


def _load(console: Console, pair: DemoPair, args):
    from specmoe import LLM
    with _progress(console) as progress:
        progress.add_task(f"loading {pair.label} ({args.dtype})", total=None)
        t0 = time.perf_counter()
        llm = LLM(pair.model, speculative=pair.speculative, dtype=args.dtype,
                  device=args.device, max_model_len=args.max_model_len,
                  quantization=args.quantization)
    console.print(f"loaded {pair.label} in {time.perf_counter() - t0:.1f} s "
                  f"({llm.config.model.dtype})")
    return llm


def _progress(console: Console) -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=console, transient=True)


def _prompt(llm, pair: DemoPair, text: str, max_tokens: int) -> str | list[int]:
    """The chat-wrapped text for an instruction model; for a base model the text's first
    token ids, as many as leave room for `max_tokens` within the model's context."""
    if pair.chat:
        return llm.chat_prompt([{"role": "user", "content": text}])
    budget = llm.max_model_len - max_tokens
    return llm.tokenizer(text, add_special_tokens=False, truncation=True,
                         max_length=budget)["input_ids"]


def _run_pair(console, llm, pair, texts, categories, modes, max_tokens) -> list[DemoRow]:
    """Warm-up (untimed), then each prompt in both modes, the order alternating."""
    rows = []
    with _progress(console) as progress:
        task = progress.add_task(f"{pair.label}: warm-up", total=None)
        warm = _prompt(llm, pair, WARM_UP_PROMPT, max_tokens)
        for params in modes.values():
            llm.generate(warm, params)
        for i, (text, category) in enumerate(zip(texts, categories)):
            progress.update(task, description=f"{pair.label}: prompt {i + 1}/{len(texts)}")
            timed = {}
            for mode in (("plain", "spec") if i % 2 == 0 else ("spec", "plain")):
                llm.reset_prefix_cache()  # the second mode would reuse the first's prefill
                t = time.perf_counter()
                out = llm.generate(text, modes[mode])[0]
                timed[mode] = (out, time.perf_counter() - t)
            rows.append(DemoRow(pair.short, category, *timed["plain"], *timed["spec"]))
    return rows


def _table(rows: list[DemoRow], args, labels: list[str]) -> Table:
    table = Table(title=f"plain vs speculative decoding, end-to-end tokens/s: greedy, up to "
                        f"{args.max_tokens} tokens, after a warm-up; same: identical tokens",
                  caption="; ".join(labels))
    for col in ("prompt", "tokens", "plain", "spec", "speedup", "accept. len", "same"):
        table.add_column(col, justify="left" if col == "prompt" else "right",
                         min_width=18 if col == "prompt" else None, no_wrap=col == "prompt")
    for label in dict.fromkeys(r.label for r in rows):
        mine = [r for r in rows if r.label == label]
        table.add_row(f"[bold]{label}[/bold]")
        for r in mine:
            table.add_row(r.category, str(len(r.plain.token_ids)),
                          f"{len(r.plain.token_ids) / r.plain_s:.1f}",
                          f"{len(r.spec.token_ids) / r.spec_s:.1f}",
                          f"{r.plain_s / r.spec_s:.2f}x",
                          f"{r.spec.spec_stats.mean_acceptance_length:.2f}",
                          "yes" if r.plain.token_ids == r.spec.token_ids else "[red]NO[/red]")
        table.add_row("[bold]pooled[/bold]", "", "", "", f"[bold]{pooled_speedup(mine):.2f}x[/bold]",
                      "", f"{sum(r.plain.token_ids == r.spec.token_ids for r in mine)}"
                      f"/{len(mine)}", end_section=True)
    return table


def pooled_speedup(rows: list[DemoRow]) -> float:
    """Total tokens/s with speculation over total tokens/s without, over the timed runs."""
    plain = sum(len(r.plain.token_ids) for r in rows) / sum(r.plain_s for r in rows)
    spec = sum(len(r.spec.token_ids) for r in rows) / sum(r.spec_s for r in rows)
    return spec / plain


def _print_sample(console: Console, row: DemoRow) -> None:
    console.print(f"\n[bold]{row.label}, {row.category}[/bold] output (both modes):")
    console.print(row.plain.text[:600], markup=False)
