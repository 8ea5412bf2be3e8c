"""Per run at C: its steps split into decode-only steps at the full batch, decode-only steps of a
smaller batch (the run's tail) and steps with a prompt chunk: count, seconds, tokens, drafts.
Usage: python steps_split.py results.json[.gz] C mode,mode,..."""
import json, sys, collections, gzip
p = sys.argv[1]; C = int(sys.argv[2]); modes = sys.argv[3].split(",")
d = json.load(gzip.open(p) if p.endswith("gz") else open(p))
for r in d["runs"]:
    if r["concurrency"] != C or r["mode"] not in modes: continue
    st = r["steps"]
    dec = [s for s in st if s[2] == s[1] + s[3]]; pre = [s for s in st if s[2] != s[1] + s[3]]
    bsz = collections.Counter(s[1] for s in dec)
    def agg(a): return f"{len(a)} steps {sum(s[0] for s in a):.3f}s tok {sum(s[6] for s in a)} drafts {sum(s[3] for s in a)}"
    full = [s for s in dec if s[1] == C]
    print(f"rep{r['rep']} {r['mode']:9s} {r['tokens_per_s']:.0f} tok/s wall {r['wall_seconds']:.3f} | dec {agg(dec)} | full-B dec {agg(full)} ms/step {1000*sum(s[0] for s in full)/max(1,len(full)):.1f} tok/s {sum(s[6] for s in full)/max(1e-9,sum(s[0] for s in full)):.0f} | pre {agg(pre)} | B<C dec {agg([s for s in dec if s[1] < C])}")
