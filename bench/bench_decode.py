"""Decode speed on the embedded SmolLM2-135M: our engine without speculation, with n-gram
speculation, and transformers' own `generate` on the same weights and prompts.

Every mode runs on every prompt in every repetition, interleaved in one process, so the
machine's drift hits all modes alike; ratios are computed per repetition and reported as
min and median. Each run emits exactly --max-tokens tokens (end-of-sequence is ignored).

    python bench/bench_decode.py [--dtypes float32,bfloat16] [--num-prompts 5]
                                 [--max-tokens 128] [--reps 3] [--k 4] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specmoe import LLM
from specmoe.bench.peers import hf_generate, load_transformers_model, ours_generate
from specmoe.utils.data import load_prompts

MODES = ("ours_plain", "ours_ngram", "transformers")


def bench_dtype(args, dtype: str, prompts: list[str]) -> dict:
    llm = LLM(args.model, speculative={"method": "ngram", "num_speculative_tokens": args.k},
              dtype=dtype)
    hf = load_transformers_model(args.model, getattr(torch, dtype))
    encoded = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    runs = {m: [] for m in MODES}  # per rep: (tokens, seconds)
    mismatches = 0
    for rep in range(args.reps):
        totals = {m: [0, 0.0] for m in MODES}
        for ids in encoded:
            plain, t_plain = ours_generate(llm, ids, 0, args.max_tokens)
            spec, t_spec = ours_generate(llm, ids, args.k, args.max_tokens)
            ref, t_hf = hf_generate(hf, ids, args.max_tokens)
            mismatches += plain != spec
            for m, toks, t in zip(MODES, (plain, spec, ref), (t_plain, t_spec, t_hf)):
                totals[m][0] += len(toks)
                totals[m][1] += t
        for m in MODES:
            runs[m].append(totals[m][0] / totals[m][1])
        print(f"  [{dtype}] rep {rep + 1}/{args.reps}: " + ", ".join(
            f"{m} {runs[m][-1]:.1f} tok/s" for m in MODES), flush=True)
    return summarize(runs, mismatches, len(encoded) * args.reps)


def summarize(runs: dict, mismatches: int, num_runs: int) -> dict:
    def stats(xs):
        return {"min": min(xs), "median": statistics.median(xs)}
    ratio = lambda a, b: [x / y for x, y in zip(runs[a], runs[b])]  # noqa: E731
    return {
        "tokens_per_s": {m: stats(runs[m]) for m in MODES},
        "raw_tokens_per_s": runs,
        "ratios": {
            "ours_plain / transformers": stats(ratio("ours_plain", "transformers")),
            "ours_ngram / transformers": stats(ratio("ours_ngram", "transformers")),
            "ours_ngram / ours_plain": stats(ratio("ours_ngram", "ours_plain")),
        },
        "greedy_mismatches_plain_vs_ngram": f"{mismatches}/{num_runs}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the JSON results here")
    args = ap.parse_args()
    prompts = [p.text for p in load_prompts(args.dataset, args.num_prompts)]
    print(f"{args.model}: {len(prompts)} {args.dataset} prompts x {args.max_tokens} tokens, "
          f"{args.reps} reps, {torch.get_num_threads()} threads, n-gram K={args.k}")
    results = {d: bench_dtype(args, d, prompts) for d in args.dtypes.split(",")}
    for dtype, r in results.items():
        print(f"\n{dtype}: tokens/s (min / median over reps)")
        for m, s in r["tokens_per_s"].items():
            print(f"  {m:14s} {s['min']:7.2f} / {s['median']:7.2f}")
        for name, s in r["ratios"].items():
            print(f"  {name:28s} {s['min']:.2f}x / {s['median']:.2f}x")
        print(f"  greedy mismatches plain vs ngram: {r['greedy_mismatches_plain_vs_ngram']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
