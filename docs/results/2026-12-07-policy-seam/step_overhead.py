"""Seconds per engine step outside the target forward: SmolLM2-135M with prompt lookup at
static K = 4, 16 code prompts in flight, 48 greedy tokens each, three repetitions.
Run from a checkout of the commit to measure, its code first on the path:
    PYTHONPATH=$PWD python step_overhead.py LABEL"""
import sys
import time

from specmoe import LLM, SamplingParams

llm = LLM("smollm2-135m", speculative={"method": "ngram", "num_speculative_tokens": 4},
          scheduler={"max_num_seqs": 16})
core, forward_s, execute = llm.engine, [0.0], llm.target.execute


def timed(*args, **kwargs):
    t = time.perf_counter()
    out = execute(*args, **kwargs)
    forward_s[0] += time.perf_counter() - t
    return out


llm.target.execute = timed
prompts = [f"def f{i}(x):\n    return x * {i} + " for i in range(16)]
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
for rep in range(3):
    forward_s[0] = 0.0
    core.reset_stats()
    t = time.perf_counter()
    llm.generate(prompts, params)
    total, steps = time.perf_counter() - t, core.stats.num_steps
    print(f"{sys.argv[1]} rep{rep} steps {steps} total {total:.3f}s forward {forward_s[0]:.3f}s "
          f"outside the forward {1000 * (total - forward_s[0]) / steps:.3f} ms/step")
