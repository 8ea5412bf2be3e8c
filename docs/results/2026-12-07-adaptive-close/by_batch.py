"""Decode steps (no prompt chunk) of one C of a bench results.json[.gz], per mode and batch
size: steps, mean milliseconds, drafts and tokens emitted per step. Usage: python
by_batch.py results.json[.gz] C [MODES=plain,static:1,adaptive]"""
import collections
import gzip
import json
import sys

path, C = sys.argv[1], int(sys.argv[2])
modes = (sys.argv[3] if len(sys.argv) > 3 else "plain,static:1,adaptive").split(",")
d = json.load(gzip.open(path) if path.endswith("gz") else open(path))
agg = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0, 0, 0]))
for run in d["runs"]:
    if run["concurrency"] != C:
        continue
    for sec, nreq, ntok, ndraft, _, _, emitted in run["steps"]:
        if ntok > nreq + ndraft:  # a prompt chunk rode along
            continue
        a = agg[run["mode"]][nreq]
        a[0], a[1], a[2], a[3] = a[0] + 1, a[1] + sec, a[2] + ndraft, a[3] + emitted
for m in modes:
    print(f"{m:9s}", " ".join(f"B{b}: {a[0]} steps {1000 * a[1] / a[0]:.1f} ms d{a[2] / a[0]:.1f} "
                              f"e{a[3] / a[0]:.2f} |" for b, a in sorted(agg[m].items())))
