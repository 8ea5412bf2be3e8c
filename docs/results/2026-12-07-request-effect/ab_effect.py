# Record of commit 18c02d3: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at 18c02d3`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""A/B of the request effect on the acceptance prior (`AcceptanceTracker.request_effect`):
step-overhead's ab_prompt.py (plain, plain2, static:1 or static:2, adaptive), plus
`adaptive_noeffect`, an adaptive engine whose deeper positions keep the engine-wide prior
whatever the request's first position reads. Usage: [AB_MODEL=tiny-moe|qwen] python
ab_effect.py C REPS [NUM_REQUESTS=16] [RANGE_RATIO=0]. Run from this folder."""
import os
import sys

sys.argv = sys.argv[:5] + [""] * (5 - len(sys.argv)) + ["mg5"]  # mg5: the default min_gain
here = os.path.dirname(os.path.abspath(__file__))
os.chdir(os.path.join(here, "..", "2026-12-06-step-overhead"))
src = open("ab_prompt.py").read()
marker = "warm_up(engines, prompts)"
pre, post = src.split(marker)
exec(pre)
other = engines.pop("adaptive_mg5")  # noqa: F821 (defined by ab_prompt.py)
other.engine.policy.acceptance.request_effect = False
engines["adaptive_noeffect"] = other  # noqa: F821
exec(marker + post)
