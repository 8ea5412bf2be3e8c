# Record of commit c1edc10: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at c1edc10`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""Milliseconds per step each engine spends in each part of its step (the target's forward,
verification, drafting, the policy's choice and observation, shadows, scheduling), on the
mixed workload with spread lengths at one C (ab_prompt.py's engines, with its noshadow
variant), balanced 0.1 s turns; each part's calls after a slash, and the whole step as the
bench times it. Usage: [AB_MODEL=tiny-moe] python oh_parts.py C [REPS=2 [NUM_REQUESTS=16
RANGE_RATIO=0.5 VARIANTS=noshadow]]. Run from this folder."""
import sys, time, collections
C = sys.argv[1]; REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
sys.argv = ["x", C, "1"] + (sys.argv[3:6] if len(sys.argv) > 5 else ["16", "0.5", "noshadow"])
src = open("ab_prompt.py").read()
marker = "warm_up(engines, prompts)"
pre, post = src.split(marker)
exec(pre)
exec(marker)
acc = {m: collections.Counter() for m in engines}
PARTS = ["_forward", "_verify", "_verify_isolated", "_emit", "_verify_row", "_propose", "_draft_ks", "_observe_policy", "_resolve_shadows",
         "_shadow_propose", "_leased_step", "_cut_beside_prompts"]
def wrap(obj, name, m, key):
    f = getattr(obj, name, None)
    if f is None: return
    def w(*a, f=f, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[m][key] += time.perf_counter() - t; acc[m]["n_" + key] += 1
    setattr(obj, name, w)
for m, e in engines.items():
    core = e.engine
    for p in PARTS: wrap(core, p, m, p)
    wrap(core.scheduler, "schedule", m, "schedule")
    wrap(core.scheduler, "update_from_output", m, "update")
    wrap(core.stats, "record_step", m, "record_step")
modes = list(engines)
with frozen_heap():
    for rep in range(REPS):
        done = run_interleaved(engines, modes, prompts, int(C), cfg.max_tokens, cfg.num_requests,
                               arrival="closed", start=rep, slice_seconds=0.1)
        for m in modes:  # the runner's own step timings (it replaces `step` each turn)
            acc[m]["step"] += sum(s[0] for s in done[m]["steps"])
            acc[m]["n_step"] += len(done[m]["steps"])
for m in modes:
    a = acc[m]; n = a["n__forward"]
    print(f"{m:18s} steps {n:4d} | " + " ".join(
        f"{k.strip('_')} {1000*a[k]/n:.4f}/{a['n_' + k]}" for k in ["step", "_forward", "_verify", "_verify_isolated", "_emit", "_verify_row", "_propose", "_draft_ks",
        "_observe_policy", "_resolve_shadows", "_shadow_propose", "_leased_step", "_cut_beside_prompts", "schedule", "update", "record_step"] if a["n_"+k]))
