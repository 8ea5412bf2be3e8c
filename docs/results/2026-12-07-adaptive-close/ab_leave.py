# Record of commit 0904d74: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at 0904d74`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""A/B of re-solving a speculating batch when requests leave (`AdaptivePolicy._admits`):
step-overhead's ab_prompt.py (plain, plain2, static:1 or static:2, adaptive), plus
`adaptive_hold`, an adaptive engine that keeps its held Ks when requests leave. Run at
38aaf96, where `adaptive` re-solved on a leave; from 7066b49 on (the change reverted) both
engines hold. Usage: [AB_MODEL=tiny-moe|qwen] python ab_leave.py C REPS
[NUM_REQUESTS=16] [RANGE_RATIO=0]. Run from this folder."""
import os
import sys
import types

from specmoe.spec_decode.adaptive import AdaptivePolicy

sys.argv = sys.argv[:5] + [None] * (5 - len(sys.argv)) + ["mg5"]  # mg5: the default min_gain
sys.argv = [a if a is not None else "" for a in sys.argv]
here = os.path.dirname(os.path.abspath(__file__))
os.chdir(os.path.join(here, "..", "2026-12-06-step-overhead"))
src = open("ab_prompt.py").read()
marker = "warm_up(engines, prompts)"
pre, post = src.split(marker)
exec(pre)


def holding_admits(self, held, request_ids):
    """`_admits` as it was: a hold with no request joined goes on whoever left."""
    joined = held.joined(request_ids)
    if joined is not None and not joined and not held.admitted:
        return True
    return AdaptivePolicy._admits(self, held, request_ids)


hold = engines.pop("adaptive_mg5")  # noqa: F821 (defined by ab_prompt.py)
hold.engine.policy._admits = types.MethodType(holding_admits, hold.engine.policy)
engines["adaptive_hold"] = hold  # noqa: F821
exec(marker + post)
