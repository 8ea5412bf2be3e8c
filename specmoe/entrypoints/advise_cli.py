"""`specmoe advise`: the command line of `analysis.advise`, with a table and the
batch-size table to paste into a config."""

from __future__ import annotations

import json
from pathlib import Path

from specmoe.entrypoints.args import apply_threads, comma_list


def add_advise_parser(sub) -> None:
    from specmoe.analysis.advise import AdviseConfig
    d = AdviseConfig(model="", draft="")
    p = sub.add_parser("advise", help="will speculation pay on my model, draft and prompts? "
                       "best K per batch size and a batch_size_table, measured in minutes")
    p.add_argument("--model", help="target model: alias or path (required unless "
                                    "--from-advice)")
    p.add_argument("--draft", help="draft model (alias or path) or 'ngram' (required "
                                    "unless --from-advice)")
    p.add_argument("--draft-quantization", default=None, choices=["int8", "int4", "gguf"],
                   help="quantise the draft model's weights")
    p.add_argument("--prompts", default=None,
                   help="a .txt file (one prompt per line) or .jsonl (a 'prompt' or 'text' "
                        "field per line); default: Spec-Bench and MT-Bench prompts")
    p.add_argument("--datasets", type=comma_list(str), default=None,
                   help="instead of --prompts: `bench throughput`'s data sets, its prompts "
                        "chosen as it chooses them (e.g. spec_bench,mt_bench)")
    p.add_argument("--spec-bench-categories", type=comma_list(str), default=None,
                   help="Spec-Bench tasks for --datasets (default: the bench's)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts to use (default: the largest batch size); with --datasets "
                        "give the bench's --num-requests to get its prompts")
    p.add_argument("--compare", default=None, metavar="BENCH_RESULTS",
                   help="score the advice against a `bench throughput` results.json (or "
                        ".json.gz) whose static:K modes ran at these batch sizes")
    p.add_argument("--from-advice", default=None, metavar="ADVICE_JSON",
                   help="with --compare: an advice.json written before, nothing measured")
    p.add_argument("--batch-sizes", type=comma_list(int),
                   default=",".join(map(str, d.batch_sizes)),
                   help="batch sizes to advise on (default: %(default)s)")
    p.add_argument("--max-k", type=int, default=d.max_k, help="largest K (default: 8)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="greedy tokens per prompt for the acceptance replay (default: 64)")
    p.add_argument("--reps", type=int, default=d.reps,
                   help="repetitions of every timing (default: %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--out", default=None, help="also write advice.json here (a directory)")


def read_prompts(path: str) -> list[str]:
    """Prompt texts of a .txt (a line each) or .jsonl file ('prompt' or 'text' field).

    Raises:
        ValueError: no such file, a bad JSON line, a line without a prompt, or no prompt.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    lines = [ln for ln in file.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if file.suffix != ".jsonl":
        prompts = lines
    else:
        prompts = []
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"--prompts {path}, line {i}: not JSON ({exc})") from exc
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"--prompts {path}, line {i}: no 'prompt' or 'text' string")
            prompts.append(text)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt in it")
    return prompts


def cmd_advise(args) -> int:
    """Advise (or read `--from-advice`), print, write, and score against `--compare`."""
    from specmoe.analysis.advise import read_results
    if args.from_advice:
        if not args.compare:
            raise ValueError("--from-advice needs --compare BENCH_RESULTS")
        result = read_results(args.from_advice)
    elif not (args.model and args.draft):
        raise ValueError("--model and --draft are required (or --from-advice with --compare)")
    else:
        result = _advise(args)
    if args.compare:
        print_comparison(result, read_results(args.compare))
    return 0


def _advise(args) -> dict:
    from rich.console import Console

    from specmoe.analysis.advise import AdviseConfig, advise
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file: advise writes advice.json into a "
                         "directory")
    apply_threads(args)
    cfg = AdviseConfig(model=args.model, draft=args.draft,
                       prompts=read_prompts(args.prompts) if args.prompts else None,
                       num_prompts=args.num_prompts, datasets=args.datasets,
                       spec_bench_categories=args.spec_bench_categories,
                       draft_quantization=args.draft_quantization,
                       batch_sizes=args.batch_sizes, max_k=args.max_k,
                       max_tokens=args.max_tokens, reps=args.reps, dtype=args.dtype)
    console = Console(stderr=True)
    result = advise(cfg, lambda msg: console.print(f"[bold]{msg}[/]"))
    print_advice(result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "advice.json").write_text(json.dumps(result, indent=1))
        print(f"advice: {out / 'advice.json'}")
    return result


def _console():
    from rich.console import Console
    console = Console()
    if not console.is_terminal:  # a pipe or file: the whole table, not cut to 80 columns
        console = Console(width=160)
    return console


def print_advice(result: dict) -> None:
    """The predicted speedup per B and K, the acceptance and the batch_size_table."""
    from rich.table import Table
    cfg = result["config"]
    table = Table(title=f"{cfg['model']} with {cfg['draft']}: predicted speedup over plain, "
                        f"end to end ({cfg['max_tokens']} tokens per request, prefill "
                        "included; decode steps alone in brackets)")
    for col in ("B", "best K", "speedup", "pays", *(f"K={a['k']}" for a in result["acceptance"])):
        table.add_column(col)
    for b, best in result["best"].items():
        rows = {r["K"]: r for r in result["rows"] if r["B"] == b}
        cells = [f"{r['predicted_speedup']:.2f}" for r in rows.values()]
        decode = f" ({rows[best['K']]['decode_speedup']:.2f}x)" if best["K"] else ""
        table.add_row(str(b), str(best["K"]), f"{best['predicted_speedup']:.2f}x{decode}",
                      "yes" if best["K"] else "no", *cells)
    _console().print(table)
    tps = ", ".join(f"K={a['k']} {a['tokens_per_step']:.2f}" for a in result["acceptance"])
    print(f"tokens per verification step: {tps}")
    print("batch_size_table: " + json.dumps(result["batch_size_table"]))


def print_comparison(advice: dict, bench: dict) -> None:
    """`compare_with_bench` as a table and its median error."""
    from rich.table import Table

    from specmoe.analysis.advise import compare_with_bench
    cmp = compare_with_bench(advice, bench)
    table = Table(title="advised against measured (bench throughput, static K at C = B)")
    for col in ("B", "K", "predicted", "measured", "error"):
        table.add_column(col)
    for r in cmp["rows"]:
        table.add_row(str(r["B"]), str(r["K"]), f"{r['predicted']:.2f}x",
                      f"{r['measured']:.2f}x", f"{100 * r['error']:.1f}%")
    _console().print(table)
    best = ", ".join(f"B={b}: advised K={v['advised_K']}, measured best K={v['measured_best_K']}"
                     for b, v in cmp["best"].items())
    print(f"median error {100 * cmp['median_error']:.1f}% over {len(cmp['rows'])} (B, K); {best}")
