"""Per mode at one C of a bench results.json[.gz]: seconds and tokens emitted in the steps with
a prompt chunk, in decode steps at the full batch (C requests) and in decode steps below it (the
drain at the end of a finite run, or gaps while requests join), averaged over the repetitions.
Usage: python drain.py results.json[.gz] C"""
import json, sys, gzip, collections
path, C = sys.argv[1], int(sys.argv[2])
d = json.load(gzip.open(path) if path.endswith("gz") else open(path))
agg = collections.defaultdict(lambda: collections.defaultdict(list))
for run in d["runs"]:
    if run["concurrency"] != C: continue
    parts = collections.Counter()
    for sec, nreq, ntok, ndraft, npre, nlog, emitted in run["steps"]:
        kind = "pre" if ntok > nreq + ndraft else ("full" if nreq >= C else "below")
        parts[kind + "_s"] += sec; parts[kind + "_tok"] += emitted; parts[kind + "_n"] += 1
    for k, v in parts.items(): agg[run["mode"]][k].append(v)
    agg[run["mode"]]["wall"].append(run["wall_seconds"])
for m, a in agg.items():
    f = lambda k: sum(a[k]) / len(a[k]) if a[k] else 0.0
    print(f"{m:9s} wall {f('wall'):.3f} | pre {f('pre_n'):4.1f} steps {f('pre_s'):.3f}s {f('pre_tok'):5.1f} tok | full {f('full_n'):5.1f} steps {f('full_s'):.3f}s {f('full_tok'):5.1f} tok ({f('full_tok')/max(f('full_s'),1e-9):.0f}/s) | below {f('below_n'):5.1f} steps {f('below_s'):.3f}s {f('below_tok'):5.1f} tok ({f('below_tok')/max(f('below_s'),1e-9):.0f}/s)")
