# Record of commit c1edc10: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at c1edc10`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""What the adaptive policy believes on the mixed workload (spread lengths) at one C after REPS
balanced repetitions: its step-time fit against the decode-only steps measured in each mode,
its drafting cost, realized factors and engine-wide acceptance and fill counts (rows: slots
reached / accepted; filled: allowed / filled). Usage: python diag.py C REPS. Run from this folder."""
import sys, collections, numpy as np
C = int(sys.argv[1]); reps = int(sys.argv[2])
sys.argv = ["x", str(C), "1", "16", "0.5", "z0"]
src = open("ab_prompt.py").read()
pre, post = src.split("warm_up(engines, prompts)")
exec(pre); warm_up(engines, prompts)
del engines["adaptive_z0"]
modes = list(engines)
meas = {m: collections.defaultdict(list) for m in modes}
with frozen_heap():
    for rep in range(reps):
        done = run_interleaved(engines, modes, prompts, C, cfg.max_tokens, cfg.num_requests,
                               arrival="closed", start=rep, slice_seconds=0.1)
        for m in modes:
            for s in done[m]["steps"]:
                sec, nreq, ntok, ndraft = s[:4]
                if ntok == nreq + ndraft:  # decode-only
                    meas[m][ntok].append(sec)
        print(rep, {m: round(done[m]["tokens_per_s"] / done["plain"]["tokens_per_s"], 3) for m in modes})
p = engines["adaptive"].engine.policy
print("coef", p.step_time.coef)
rows_seen = collections.Counter(r for r, _, _ in p.step_time._steps)
print("window rows", sorted(rows_seen.items())[:40], "... n", len(p.step_time._steps))
for r in [1, 2, 4, 6, 8, 9, 10, 12, 14, 16, 20, 24, 32, 64, 128]:
    pr = p.step_time.predict_one(r)
    ms = {m: (len(meas[m][r]), round(1000 * float(np.median(meas[m][r])), 2)) for m in modes if meas[m].get(r)}
    print(f"rows {r:3d} predicted {1000*pr:6.2f} ms | measured decode-only {ms}")
print("draft_s", p.draft_s, "realized", p.realized.factors)
print("acceptance engine-wide", p.acceptance.engine, "fill", p.acceptance.engine_fill)
print("solves", p._solves, "solve ms", 1000*p._solve_s)
