"""Greedy token ids of one commit under static, batch-size-table and adaptive speculation,
written as JSON, so that two commits' outputs can be compared id for id.

Usage (from a checkout of the commit to measure, its package importable):
    python same_tokens.py OUT.json [--cases tiny-moe,smollm2-ngram,qwen-pair]
    python same_tokens.py --compare A.json B.json

Each case runs its prompts at four requests in flight (batched verification, requests
joining and leaving) and alone, 32 greedy tokens each, under every policy. Plain decoding
is recorded too: every speculative run must equal it (greedy speculation is lossless), and
each must equal the other commit's.
"""
import argparse
import json
import sys

from specmoe import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to French: The weather is nice today and we will walk to the market.",
    "List the planets of the solar system in order from the sun:",
    "import numpy as np\n\ndef normalise(x):\n",
    "Write a haiku about the sea.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]
POLICIES = {
    "static:4": {"num_speculative_tokens": 4},
    "table": {"num_speculative_tokens": 4, "policy": "batch_size_table",
              "batch_size_table": {"1-2": 4, "3-4": 2, "5-64": 0}},
    "adaptive": {"num_speculative_tokens": 4, "policy": "adaptive"},
}
CASES = {
    "tiny-moe": ("tiny-moe", {"method": "draft", "draft_model": "tiny-moe-draft"}),
    "smollm2-ngram": ("smollm2-135m", {"method": "ngram"}),
    "qwen-pair": ("qwen2.5-coder-1.5b", {"method": "draft",
                                         "draft_model": "qwen2.5-coder-0.5b"}),
}


def run(llm: LLM, params: SamplingParams) -> dict:
    """Token ids of every prompt at four in flight, then of the first two alone."""
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS[:2]]
    return {"batched": [o.token_ids for o in batched], "alone": [o.token_ids for o in alone]}


def measure(cases: list[str]) -> dict:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    out = {}
    for case in cases:
        model, method = CASES[case]
        llm = LLM(model, scheduler={"max_num_seqs": 4})
        out[case] = {"plain": run(llm, params)}
        for name, fields in POLICIES.items():
            spec = llm.with_speculative({**method, **fields})
            out[case][name] = run(spec, params)
            print(case, name, "done", file=sys.stderr, flush=True)
        del llm, spec
    return out


def compare(a: dict, b: dict) -> int:
    """Prints one line per case and policy; returns the number of mismatches."""
    bad = 0
    for case in sorted(set(a) | set(b)):
        for name in sorted(set(a.get(case, {})) | set(b.get(case, {}))):
            ra, rb = a.get(case, {}).get(name), b.get(case, {}).get(name)
            same = ra == rb
            lossless = ra == a[case]["plain"] and rb == b[case]["plain"]
            bad += (not same) + (not lossless)
            print(f"{case:14s} {name:9s} same ids across commits: {same}; "
                  f"equal to plain in both: {lossless}")
    return bad


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        sys.exit(1 if compare(*(json.load(open(p)) for p in args.compare)) else 0)
    json.dump(measure(args.cases.split(",")), open(args.out, "w"))
