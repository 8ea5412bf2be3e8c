# Record of commit 1564bdd: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at 1564bdd`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""What the adaptive policy's choices cost on tiny-moe with its draft at one C, timed
uninstrumented: each `AdaptivePolicy.choose` call (a solve, or the held path on the steps
the engine does not lease), over one run of NUM_REQUESTS requests of 128 tokens, against the
run's steps. Usage: python solve_time.py C [NUM_REQUESTS=32]. Run from this folder."""
import os
import statistics
import sys
import time

C = int(sys.argv[1])
n = sys.argv[2] if len(sys.argv) > 2 else "32"
os.environ["AB_MODEL"] = "tiny-moe"
sys.argv = ["x", str(C), "1", n, "0", "z0"]
here = os.path.dirname(os.path.abspath(__file__))
os.chdir(os.path.join(here, "..", "2026-12-06-step-overhead"))
pre = open("ab_prompt.py").read().split("warm_up(engines, prompts)")[0]
exec(pre)
warm_up(engines, prompts)  # noqa: F821 (defined by ab_prompt.py)
policy = engines["adaptive"].engine.policy  # noqa: F821
choose, times = policy.choose, []


def timed(*a, **k):
    t = time.perf_counter()
    try:
        return choose(*a, **k)
    finally:
        times.append(time.perf_counter() - t)


policy.choose = timed
solves = policy._solves
with frozen_heap():  # noqa: F821
    done = run_interleaved(engines, ["adaptive"], prompts, C, cfg.max_tokens,  # noqa: F821
                           cfg.num_requests, arrival="closed", start=0, slice_seconds=0.1)
steps = done["adaptive"]["steps"]
step_s = sum(s[0] for s in steps)
print(f"C={C}: {len(steps)} steps, {1000 * step_s:.0f} ms; choose called {len(times)} times "
      f"({policy._solves - solves} solves), {1000 * sum(times):.1f} ms "
      f"({100 * sum(times) / step_s:.2f}% of the steps), median {1e6 * statistics.median(times):.0f} us, "
      f"max {1000 * max(times):.2f} ms")
