"""Per C of a bench results.json[.gz]: adaptive / plain (median of per-repetition ratios, range),
the best static K (by its median ratio to plain), adaptive / that K, and the A/A range.
Usage: python best.py results.json"""
import json, sys, gzip, statistics as st
p = sys.argv[1]
d = json.load(gzip.open(p) if p.endswith("gz") else open(p))
t = {}
for r in d["runs"]:
    t[(r["concurrency"], r["rep"], r["mode"])] = r["tokens_per_s"]
Cs = sorted({k[0] for k in t}); reps = sorted({k[1] for k in t}); modes = sorted({k[2] for k in t})
statics = [m for m in modes if m.startswith("static")]
for C in Cs:
    # best static by median over reps of x plain
    med = {m: st.median(t[(C, r, m)] / t[(C, r, "plain")] for r in reps) for m in statics}
    best = max(med, key=med.get)
    ap = [t[(C, r, "adaptive")] / t[(C, r, "plain")] for r in reps]
    ab = [t[(C, r, "adaptive")] / t[(C, r, best)] for r in reps]
    aa = [t[(C, r, "plain2")] / t[(C, r, "plain")] for r in reps] if (C, reps[0], "plain2") in t else []
    print(f"C={C:3d} adaptive/plain {st.median(ap):.3f} ({min(ap):.3f}-{max(ap):.3f}) | best static {best} {med[best]:.3f}x plain | adaptive/best {st.median(ab):.3f} ({min(ab):.3f}-{max(ab):.3f}) | A/A {min(aa):.3f}-{max(aa):.3f}")
