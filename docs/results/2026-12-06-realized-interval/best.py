"""Per C of a bench results.json[.gz]: the issue-26 targets as the bench computed them
(`throughput_stats.policy_targets`, in the report's Targets line): adaptive / plain and
adaptive / the best static K of each repetition (medians of per-repetition ratios), the best
static K most often, and the A/A engine's range; then the bench's verdict.
Usage: python best.py results.json[.gz]"""
import gzip
import json
import sys

path = sys.argv[1]
t = json.load(gzip.open(path) if path.endswith("gz") else open(path))["ratios"]["policy_targets"]
for c, v in t["per_concurrency"].items():
    aa = v["aa"] or {"min": float("nan"), "max": float("nan")}
    print(f"C={int(c):3d} adaptive/plain {v['vs_plain']:.3f} | adaptive/best static "
          f"{v['vs_best_static']:.3f} ({v['best_static']}) | A/A {aa['min']:.3f}-{aa['max']:.3f}")
print(f"worst vs plain {t['min_vs_plain']:.4f}, vs best static {t['min_vs_best_static']:.4f}: "
      f"{'met' if t['met'] else 'NOT met'}")
