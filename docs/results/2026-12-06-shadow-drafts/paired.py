"""Per repetition wall seconds of each mode in a `specmoe bench throughput` results file, the
median over repetitions of adaptive's paired ratio to each mode (above 1: adaptive faster),
and adaptive's K and shadow counts per run.

    python docs/results/2026-12-06-shadow-drafts/paired.py DIR/results.json.gz
"""
import collections
import gzip
import json
import statistics
import sys

with gzip.open(sys.argv[1]) as f:
    runs = json.load(f)["runs"]
wall = {(r["mode"], r["rep"], r["concurrency"]): r["wall_seconds"] for r in runs}
reps = sorted({rep for _, rep, _ in wall})
modes = sorted({m for m, _, _ in wall})
for c in sorted({c for _, _, c in wall}):
    print(f"C = {c}: wall seconds per repetition; adaptive's paired speed-up over the mode")
    for m in modes:
        ratio = statistics.median(wall[(m, rep, c)] / wall[("adaptive", rep, c)] for rep in reps)
        print(f"  {m:9s}", " ".join(f"{wall[(m, rep, c)]:6.2f}" for rep in reps),
              f"  {ratio:.3f}")
print("adaptive runs: repetition, C, K histogram, shadow drafts / emitted")
for r in runs:
    if r["mode"] == "adaptive":
        s = r["engine_stats"]
        hist = collections.Counter({int(k): v for k, v in s["draft_k_histogram"].items()})
        print(f"  {r['rep']} {r['concurrency']:3d} {dict(sorted(hist.items()))} "
              f"{s.get('num_shadow_draft_tokens', 0)} / {s.get('num_shadow_accepted_tokens', 0)}")
