# Record of commit 0904d74: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at 0904d74`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""What the adaptive policy chose in the drain of a finite run (batches of one or two
requests) on the mixed workload with spread lengths at eight requests (step-overhead's
ab_prompt.py engines, one repetition of 16 requests): each solve at B <= 2 with its
requests' acceptance per position, fill chances and own counts, and the asked gain; then
the step-time model's predictions against the median measured forward per row count, and
each request's drafting steps, drafts and accepted drafts. Usage: python drain_ks.py (run
from this folder)."""
import collections
import os
import sys

import numpy as np

sys.argv = ["x", "8", "1", "16", "0.5", "mg5"]
here = os.path.dirname(os.path.abspath(__file__))
os.chdir(os.path.join(here, "..", "2026-12-06-step-overhead"))
exec(open("ab_prompt.py").read().split("warm_up(engines, prompts)")[0])
warm_up(engines, prompts)  # noqa: F821 (defined by ab_prompt.py)
pol = engines["adaptive"].engine.policy  # noqa: F821
counts = collections.defaultdict(lambda: [0, 0, 0])
observe_verified, solve, log = pol.observe_verified, pol._solve, []


def counted(r, drafted, accepted):
    c = counts[r]
    c[0], c[1], c[2] = c[0] + (drafted > 0), c[1] + drafted, c[2] + accepted
    return observe_verified(r, drafted, accepted)


def logged(request_ids, caps, base_rows, pending, remaining):
    ks = solve(request_ids, caps, base_rows, pending, remaining)
    if len(request_ids) <= 2:
        acc = pol.acceptance
        log.append((request_ids, ks.tolist(),
                    [np.round(acc.rates(r)[:4], 2).tolist() for r in request_ids],
                    [np.round(acc.fills(r)[:4], 2).tolist() for r in request_ids],
                    [acc._requests.get(r, np.zeros((2, 8)))[:, :2].tolist() for r in request_ids],
                    np.round(pol._asked_gain(len(request_ids)), 3).tolist()))
    return ks


choose, picks = pol.choose, []


def traced(request_ids, *a, **k):
    solves = pol._solves
    ks = choose(request_ids, *a, **k)
    if len(request_ids) == 1:  # how each K at one request came: solve, probe or hold
        how = "solve" if pol._solves > solves else "probe" if pol._probed else "held"
        picks.append((list(ks.values())[0], how))
    return ks


pol.observe_verified, pol._solve, pol.choose = counted, logged, traced
with frozen_heap():  # noqa: F821
    done = run_interleaved({m: engines[m] for m in ("plain", "adaptive")},  # noqa: F821
                           ["plain", "adaptive"], prompts, 8, cfg.max_tokens,  # noqa: F821
                           cfg.num_requests, arrival="closed", start=0, slice_seconds=0.1)
print("adaptive / plain", round(done["adaptive"]["tokens_per_s"] / done["plain"]["tokens_per_s"], 3))
print("solves at B <= 2: (requests, Ks, rates[:4], fills[:4], own [reached, accepted] at "
      "positions 0-1, (realized factor, asked gain))")
for entry in log[-8:]:
    print(entry)
rows = np.array([1.0, 2, 3, 4, 6, 8, 10, 16, 24, 40])
print("predicted ms at rows", rows.astype(int).tolist(),
      [round(1000 * float(x), 2) for x in pol.step_time.predict(rows)])
by_rows = collections.defaultdict(list)
for r, sec, _ in pol.step_time._steps:
    by_rows[int(r)].append(sec)
print("measured ms (steps, median) by rows",
      {r: (len(v), round(1000 * float(np.median(v)), 2)) for r, v in sorted(by_rows.items()) if r <= 40})
print("realized factors by batch size", {b: round(pol.realized.factor(b), 3) for b in range(1, 9)})
print("Ks at one request, as (K, how): ", picks)
for r, (steps, drafted, accepted) in counts.items():
    print(f"request {r}: {steps} drafting steps, {drafted} drafts, {accepted} accepted")
