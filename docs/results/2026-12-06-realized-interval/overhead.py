"""Seconds each engine's steps spend outside the target's forward (scheduling, drafting, shadows,
the policy), per step, on the mixed workload with spread lengths at 32 requests (ab_z.py's
engines: plain, plain2, static:1, adaptive, adaptive_noshadow); a profile of the third repetition.
Run from this folder."""
import sys, time, cProfile, pstats
sys.argv = ["x", "32", "3", "16", "0.5", "noshadow"]
src = open(__file__.replace("overhead.py", "ab_z.py")).read()
marker = "warm_up(engines, prompts)"
pre, post = src.split(marker)
exec(pre)
exec(marker)
fw = {}
for m, e in engines.items():
    core = e.engine; f = core._forward; fw[m] = []
    def w(s, f=f, m=m):
        t = time.perf_counter(); r = f(s); fw[m].append(time.perf_counter() - t); return r
    core._forward = w
modes = list(engines)
prof = cProfile.Profile()
with frozen_heap():
    for rep in range(3):
        for m in modes: fw[m].clear()
        if rep == 2: prof.enable()
        done = run_interleaved(engines, modes, prompts, C, cfg.max_tokens, cfg.num_requests,
                               arrival="closed", start=rep, slice_seconds=0.1)
        if rep == 2: prof.disable()
        for m in modes:
            steps = done[m]["steps"]
            tot = sum(s[0] for s in steps); f = sum(fw[m])
            print(rep, m, "steps", len(steps), "fwd calls", len(fw[m]), "step %.3f fwd %.3f outside %.1f ms (%.2f ms/step)" % (tot, f, 1000*(tot-f), 1000*(tot-f)/len(steps)))
ps = pstats.Stats(prof); ps.sort_stats("cumulative")
ps.print_stats("spec_decode|engine/core|scheduler", 25)
