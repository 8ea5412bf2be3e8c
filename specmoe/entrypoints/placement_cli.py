"""`specmoe expert-placement`: an expert placement balanced from measured load, written as
the JSON file that `--expert-placement PATH` (generate, serve, bench throughput) and
`LLM(..., expert_placement=PATH)` read (`layers.moe.placement`, docs/serving.md).

The load comes from running the model on prompts (`--model`, with `--prompts` or the in-repo
Spec-Bench and MT-Bench prompts), or from a running server's per-expert counters
(`--metrics FILE`, a scrape of its /metrics). One placement serves every MoE layer, balanced
on the load summed over layers."""

from __future__ import annotations

from pathlib import Path

from specmoe.entrypoints.args import apply_threads


def add_placement_parser(sub) -> None:
    """Add `expert-placement` to the `specmoe` subcommands."""
    p = sub.add_parser("expert-placement", description=__doc__,
                       help="balance a MoE's experts over expert-parallel ranks from "
                            "measured load; writes a --expert-placement file")
    p.add_argument("--ranks", type=int, required=True,
                   help="expert-parallel size the placement is for (--expert-parallel-size)")
    p.add_argument("--out", required=True, help="the placement file to write (JSON)")
    p.add_argument("--model", default=None, help="MoE model to run (alias or path)")
    p.add_argument("--prompts", default=None,
                   help="with --model: a .txt file (one prompt per line) or .jsonl ('prompt' "
                        "or 'text' field); default: Spec-Bench and MT-Bench prompts")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="with --model and no --prompts: prompts taken (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="with --model: greedy tokens decoded per prompt (default: "
                        "%(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--metrics", default=None, metavar="FILE",
                   help="instead of --model: a scrape of `specmoe serve`'s /metrics (its "
                        "specmoe:moe_expert_load_total{layer,expert} counters)")
    p.add_argument("--num-experts", type=int, default=None,
                   help="with --metrics: routed experts per layer (default: the highest "
                        "expert id in the metrics + 1)")


def cmd_expert_placement(args) -> int:
    """Run `specmoe expert-placement`: measure, balance, write, print the comparison.

    Raises:
        ValueError: neither or both of --model and --metrics, a bad option, a dense model.
        FileNotFoundError: a missing --metrics or --prompts file.
    """
    from specmoe.layers.moe.placement import placement_report, write_placement
    if (args.model is None) == (args.metrics is None):
        raise ValueError("give one of --model (measure by running it) or --metrics (a "
                         "/metrics scrape)")
    if args.ranks < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError(f"invalid --ranks={args.ranks}, --num-prompts={args.num_prompts} "
                         f"or --max-tokens={args.max_tokens}: each must be >= 1")
    from specmoe.analysis.expert_placement import sum_over_layers
    counts, source = _from_metrics(args) if args.metrics else _from_model(args)
    load = sum_over_layers(counts)
    report = placement_report(load, args.ranks, source | {"num_layers": len(counts)})
    path = write_placement(report, args.out)
    for name, p in report["predicted"].items():
        ranks = ", ".join(f"{x:g}" for x in p["rank_load"])
        print(f"{name:>10}: per-rank load [{ranks}], max/mean {p['max_over_mean']:.3f}")
    print(f"placement ({sum(load)} pairs over {len(counts)} MoE layers): {path}")
    return 0


def _from_metrics(args) -> tuple[dict, dict]:
    from specmoe.analysis.expert_placement import load_from_metrics
    if not Path(args.metrics).is_file():
        raise FileNotFoundError(f"--metrics {args.metrics}: no such file")
    counts = load_from_metrics(Path(args.metrics).read_text(encoding="utf-8"),
                               args.num_experts)
    return counts, {"metrics": str(args.metrics)}


def _from_model(args) -> tuple[dict, dict]:
    from specmoe import LLM
    from specmoe.analysis.expert_placement import measure_expert_load, prompt_ids
    from specmoe.bench.throughput import distinct_question_texts
    from specmoe.entrypoints.advise_cli import read_prompts
    texts = (read_prompts(args.prompts) if args.prompts
             else distinct_question_texts(args.num_prompts))
    apply_threads(args)
    llm = LLM(args.model, dtype=args.dtype)
    room = max(1, llm.max_model_len - args.max_tokens)
    ids = [i[:room] for i in prompt_ids(llm, texts) if i]
    counts = measure_expert_load(llm, ids, args.max_tokens)
    source = {"model": args.model, "prompts": args.prompts or "spec_bench+mt_bench",
              "num_prompts": len(ids), "max_tokens": args.max_tokens}
    return counts, source

