"""Peak memory of one `load_model` call above the process's start: anonymous and file-backed
resident memory sampled every 10 ms, and the final weights' bytes.

    python load_peak.py MODEL DTYPE [int4|int8|none]
"""
import sys, resource, threading, time
from specmoe.config import ModelConfig
from specmoe.loader.model_loader import load_model
def status():
    d = {}
    for line in open('/proc/self/status'):
        k, _, v = line.partition(':')
        if k in ('VmRSS', 'RssAnon', 'RssFile'): d[k] = int(v.split()[0]) / 1024
    return d
peak = {'RssAnon': 0, 'RssFile': 0}
stop = False
def watch():
    while not stop:
        s = status()
        for k in peak: peak[k] = max(peak[k], s[k])
        time.sleep(0.01)
base = status()
t = threading.Thread(target=watch, daemon=True); t.start()
q = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "none" else None
m = load_model(ModelConfig(sys.argv[1], dtype=sys.argv[2], device="cpu", quantization=q))
stop = True; t.join()
final = sum(x.nbytes for x in (*m.model.parameters(), *m.model.buffers())) / 2**20
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{sys.argv[1:]}: final {final:.0f} MiB; peak above start: "
      f"anon {peak['RssAnon'] - base['RssAnon']:.0f}, "
      f"file {peak['RssFile'] - base['RssFile']:.0f} MiB; "
      f"maxrss-start {maxrss - base['VmRSS']:.0f}")
