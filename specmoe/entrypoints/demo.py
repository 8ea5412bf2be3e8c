"""`specmoe demo`: plain vs speculative decoding side by side on real prompts.

One engine serves both modes: each prompt runs once with speculation turned off for the
request (K = 0) and once with it on, interleaved, so both see the same machine state.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from specmoe.utils.data import one_per_category

DEMO_CATEGORIES = ["summarization", "rag", "coding", "math_reasoning", "translation",
                   "qa", "writing", "extraction"]


def run_demo(args) -> None:
    from specmoe import SamplingParams
    from specmoe.entrypoints.args import llm_from_args, speculative_from_args
    console = Console()
    prompts = one_per_category("spec_bench", DEMO_CATEGORIES)[:args.num_prompts]
    spec = speculative_from_args(args)
    if spec is None:
        raise ValueError("the demo compares against speculation: pass --draft ngram or a model")
    with console.status(f"loading {args.model} ({args.dtype}) with {spec['method']} "
                        "speculation..."):
        t0 = time.perf_counter()
        llm = llm_from_args(args, spec)
    console.print(f"loaded in {time.perf_counter() - t0:.1f} s; {len(prompts)} Spec-Bench "
                  f"prompts, greedy, up to {args.max_tokens} tokens")
    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("generating", total=2 * len(prompts))
        for p in prompts:
            text = llm.chat_prompt([{"role": "user", "content": p.text}])
            outs = {}
            for k in (0, args.num_speculative_tokens):
                sp = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                    num_speculative_tokens=k)
                t = time.perf_counter()
                out = llm.generate(text, sp)[0]
                outs[k] = (out, time.perf_counter() - t)
                progress.advance(task)
            rows.append((p.category, outs[0], outs[args.num_speculative_tokens]))
    console.print(_table(rows, spec))
    _print_sample(console, rows[0])


def _table(rows, spec) -> Table:
    table = Table(title=f"plain vs {spec['method']} speculation "
                        f"(K={spec['num_speculative_tokens']}), end-to-end tokens/s")
    for col in ("prompt", "tokens", "plain tok/s", "spec tok/s", "speedup",
                "acceptance length", "identical"):
        table.add_column(col, justify="right" if col != "prompt" else "left")
    total_plain = total_spec = 0.0
    for category, (base, t_base), (spec_out, t_spec) in rows:
        n = len(base.token_ids)
        total_plain, total_spec = total_plain + t_base, total_spec + t_spec
        same = base.token_ids == spec_out.token_ids
        table.add_row(category, str(n), f"{n / t_base:.1f}",
                      f"{len(spec_out.token_ids) / t_spec:.1f}", f"{t_base / t_spec:.2f}x",
                      f"{spec_out.spec_stats.mean_acceptance_length:.2f}",
                      "yes" if same else "[red]NO[/red]")
    table.add_row("all", "", "", "", f"{total_plain / total_spec:.2f}x", "", "")
    return table


def _print_sample(console: Console, row) -> None:
    category, (base, _), _ = row
    console.print(f"\n[bold]{category}[/bold] output (both modes):")
    console.print(base.text[:600], markup=False)
