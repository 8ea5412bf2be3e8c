"""Per repetition wall seconds of each mode in a `specmoe bench throughput` results file,
each mode's paired speed-up over plain (plain's wall / the mode's, per repetition, and their
median), and adaptive's over static:4 where both ran.

    python docs/results/2026-12-06-slice-interleave/paired.py DIR/results.json.gz
"""
import json, statistics, sys, gzip
p = sys.argv[1]
runs = json.load(gzip.open(p) if p.endswith('.gz') else open(p))["runs"]
wall = {(r["mode"], r["rep"], r["concurrency"]): r["wall_seconds"] for r in runs if "wall_seconds" in r}
reps = sorted({rep for _, rep, _ in wall}); modes = sorted({m for m, _, _ in wall})
for c in sorted({c for _, _, c in wall}):
    print(f"C={c}")
    for m in modes:
        r2p = [wall[("plain", rep, c)] / wall[(m, rep, c)] for rep in reps]
        print(f"  {m:9s}", " ".join(f"{wall[(m, rep, c)]:6.2f}" for rep in reps),
              " x plain:", " ".join(f"{x:.3f}" for x in r2p), f" med {statistics.median(r2p):.3f}")
    if ("static:4", 0, c) in wall:
        a = [wall[("static:4", rep, c)] / wall[("adaptive", rep, c)] for rep in reps]
        print("  adaptive/static:4", " ".join(f"{x:.3f}" for x in a), f"med {statistics.median(a):.3f}")
