#!/bin/bash
# One run of the policy-seam A/B: bench throughput of the checkout CHECKOUT (a git worktree of
# the commit to measure) into OUTDIR, with that checkout's code first on the path.
# Usage: bench_ab.sh CHECKOUT OUTDIR   (alternate the two commits: old, new, old, new)
set -e
cd "$1" && PYTHONPATH="$1" specmoe bench throughput --model smollm2-135m --draft ngram \
  --speculative-policy static:4,adaptive -k 8 --concurrency 1,4,16 --max-tokens 48 --reps 2 \
  --num-requests 16 --dtype float32 --aa-control --datasets humaneval,spec_bench \
  --spec-bench-categories translation --out "$2"
