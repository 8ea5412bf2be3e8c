"""Pooled medians of per-repetition adaptive/plain and plain2/plain over several sweeps'
results.json[.gz]. Usage: python pooled.py A/results.json B/results.json ..."""
import gzip, json, sys, statistics as st
from collections import defaultdict
ratio, aa = defaultdict(list), defaultdict(list)
for path in sys.argv[1:]:
    runs = json.load(gzip.open(path) if path.endswith("gz") else open(path))["runs"]
    tps = {(r["mode"], r["rep"], r["concurrency"]): r["tokens_per_s"] for r in runs}
    for (m, rep, c), v in tps.items():
        if m == "adaptive":
            ratio[c].append(v / tps[("plain", rep, c)])
        elif m == "plain2":
            aa[c].append(v / tps[("plain", rep, c)])
for c in sorted(ratio):
    print(f"C={c:3d} adaptive/plain median {st.median(ratio[c]):.3f} (n={len(ratio[c])}, "
          f"{min(ratio[c]):.3f}-{max(ratio[c]):.3f}) | A/A median {st.median(aa[c]):.3f} "
          f"({min(aa[c]):.3f}-{max(aa[c]):.3f})")
