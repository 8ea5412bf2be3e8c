"""`specmoe demo`: plain vs speculative decoding on real prompts, for a dense target and a MoE
target, in one table.

Each pair loads once and runs three modes: plain (speculation off per request with K = 0),
static (every request drafts K) and adaptive (the adaptive policy's engine over the same
loaded target: K per request and step, 0 where it cannot pay). Before anything is timed,
each mode generates once on a prompt outside the set, so first-call costs (kernel builds,
weight packing, allocator growth) are not counted as decoding. Then each prompt runs in
every mode back to back, the order rotating from prompt to prompt, so all see the same
machine state. Greedy decoding is lossless: the "same" column compares the token ids of the
three runs. The prefix cache is emptied before each timed run, so no mode reuses another's
prefill. Under the table, one line per pair says why speculation paid or not there.
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


# The columns of speculation beside plain decoding: every request drafting K ("static"), and
# the adaptive policy choosing K per request and step from measured acceptance and step time
# (0 where speculation cannot pay).
SPEC_MODES = ("static", "adaptive")


@dataclass
class DemoRow:
    """One prompt of one pair: `runs[mode]` = (RequestOutput, seconds) for "plain" and each
    of SPEC_MODES."""

    label: str
    category: str
    runs: dict


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
    name = {"ngram": "n-gram", "self": f"self-draft ({spec.get('self_draft_experts')} "
            "experts)"}.get(spec["method"], spec.get("draft_model"))
    return f"{name} K={spec['num_speculative_tokens']}"


def run_demo(args) -> None:
    from specmoe import SamplingParams
    console = Console()
    if not console.is_terminal:  # a pipe or a log: the whole table, not cut to 80 columns
        console = Console(width=140)
    pairs = demo_pairs(args)
    prompts = one_per_category("spec_bench", DEMO_CATEGORIES)[:args.num_prompts]
    apply_threads(args)
    # K = None: the request drafts as many tokens as its engine's proposer was set up for.
    params = {mode: SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                   num_speculative_tokens=0 if mode == "plain" else None)
              for mode in ("plain", *SPEC_MODES)}
    rows: list[DemoRow] = []
    notes = []
    for pair in pairs:
        llm = _load(console, pair, args)
        engines = {"plain": llm, "static": llm,
                   "adaptive": llm.with_speculative({**pair.speculative, "policy": "adaptive"})}
        texts = [_prompt(llm, pair, p.text, args.max_tokens) for p in prompts]
        mine = _run_pair(console, engines, pair, texts, [p.category for p in prompts], params,
                         args.max_tokens)
        rows += mine
        notes.append(why_line(pair, llm, mine))
        del llm, engines
    console.print(_table(rows, args, [p.label for p in pairs]))
    for note in notes:
        console.print(note, markup=False, soft_wrap=True)
    _print_sample(console, rows[0])


def why_line(pair: DemoPair, llm, rows: list[DemoRow]) -> str:
    """One line of why speculation pays or not on this pair, from what the run measured and
    the machine: the target's weight bytes against the last-level cache, drafting's share of
    the static mode's time, tokens per step, and both modes' pooled speed-ups."""
    stats = [r.runs["static"][0].spec_stats for r in rows]
    draft_share = sum(s.draft_time_s for s in stats) / sum(r.runs["static"][1] for r in rows)
    steps = sum(s.num_drafts for s in stats)
    per_step = 1 + sum(s.num_accepted_tokens for s in stats) / max(steps, 1)
    model = llm.target.model
    weights = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    from specmoe.analysis.presets import last_level_cache_bytes
    l3 = last_level_cache_bytes()
    where = ("" if l3 is None else
             f", {'inside' if weights <= l3 else 'beyond'} this CPU's {l3 / 1e6:.0f} MB "
             "last-level cache")
    static, adaptive = pooled_speedup(rows, "static"), pooled_speedup(rows, "adaptive")
    verdict = (f"each step's {per_step:.2f} tokens outweigh its drafting and the wider "
               "verification" if static >= 1 else
               f"{per_step:.2f} tokens a step do not pay for the drafting and the wider "
               "verification, so the adaptive policy holds K at or near 0")
    return (f"why, {pair.model}: {weights / 1e6:.0f} MB of weights{where}; drafting took "
            f"{draft_share:.0%} of the static mode's time; static {static:.2f}x, adaptive "
            f"{adaptive:.2f}x plain: {verdict}.")


def _load(console: Console, pair: DemoPair, args):
    from specmoe import LLM
    with _progress(console) as progress:
        progress.add_task(f"loading {pair.label} ({args.dtype})", total=None)
        t0 = time.perf_counter()
        llm = LLM(pair.model, speculative=pair.speculative, dtype=args.dtype,
                  device=args.device, max_model_len=args.max_model_len,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
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


def _run_pair(console, engines, pair, texts, categories, params, max_tokens
              ) -> list[DemoRow]:
    """Warm-up (untimed), then each prompt in every mode, the order rotating from prompt to
    prompt so no mode always runs first."""
    rows, modes = [], list(params)
    with _progress(console) as progress:
        task = progress.add_task(f"{pair.label}: warm-up", total=None)
        warm = _prompt(engines["plain"], pair, WARM_UP_PROMPT, max_tokens)
        for mode in modes:
            engines[mode].generate(warm, params[mode])
        for i, (text, category) in enumerate(zip(texts, categories)):
            progress.update(task, description=f"{pair.label}: prompt {i + 1}/{len(texts)}")
            runs = {}
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
                engines[mode].reset_prefix_cache()  # or a mode reuses another's prefill
                t = time.perf_counter()
                out = engines[mode].generate(text, params[mode])[0]
                runs[mode] = (out, time.perf_counter() - t)
            rows.append(DemoRow(pair.short, category, runs))
    return rows


def _table(rows: list[DemoRow], args, labels: list[str]) -> Table:
    table = Table(title=f"plain vs speculative decoding, end-to-end tokens/s: greedy, up to "
                        f"{args.max_tokens} tokens, after a warm-up; static: every request "
                        f"drafts K; adaptive: K per request and step, 0 where it cannot pay; "
                        f"x: speed-up over plain; same: identical tokens in all three",
                  caption="; ".join(labels))
    for col in ("prompt", "tokens", "plain", "static", "adaptive", "static x",
                "adaptive x", "accept. len", "same"):
        table.add_column(col, justify="left" if col == "prompt" else "right",
                         min_width=18 if col == "prompt" else None, no_wrap=col == "prompt")
    for label in dict.fromkeys(r.label for r in rows):
        mine = [r for r in rows if r.label == label]
        table.add_row(f"[bold]{label}[/bold]")
        for r in mine:
            plain_out, plain_s = r.runs["plain"]
            speeds = [f"{len(r.runs[m][0].token_ids) / r.runs[m][1]:.1f}"
                      for m in ("plain", *SPEC_MODES)]
            ratios = [f"{plain_s / r.runs[m][1]:.2f}x" for m in SPEC_MODES]
            table.add_row(r.category, str(len(plain_out.token_ids)), *speeds, *ratios,
                          f"{r.runs['static'][0].spec_stats.mean_acceptance_length:.2f}",
                          "yes" if _same(r) else "[red]NO[/red]")
        pooled = [f"[bold]{pooled_speedup(mine, m):.2f}x[/bold]" for m in SPEC_MODES]
        table.add_row("[bold]pooled[/bold]", "", "", "", "", *pooled, "",
                      f"{sum(map(_same, mine))}/{len(mine)}", end_section=True)
    return table


def _same(row: DemoRow) -> bool:
    ids = [out.token_ids for out, _ in row.runs.values()]
    return all(i == ids[0] for i in ids)


def pooled_speedup(rows: list[DemoRow], mode: str = "static") -> float:
    """Total tokens/s in `mode` over total tokens/s of plain decoding, over the timed runs."""
    def rate(m: str) -> float:
        return (sum(len(r.runs[m][0].token_ids) for r in rows)
                / sum(r.runs[m][1] for r in rows))
    return rate(mode) / rate("plain")


def _print_sample(console: Console, row: DemoRow) -> None:
    console.print(f"\n[bold]{row.label}, {row.category}[/bold] output (every mode):")
    console.print(row.runs["plain"][0].text[:600], markup=False)
