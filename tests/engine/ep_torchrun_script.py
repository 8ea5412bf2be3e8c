"""Run under torchrun by tests/engine/test_expert_parallel_engine.py: every rank runs this
same script; rank 0 prints the greedy tokens of tiny-moe under expert_parallel_size=2 (ranks
> 0 serve as workers inside LLM(...) and exit there)."""

import json
import sys

from specmoe import LLM, SamplingParams

llm = LLM("tiny-moe", dtype="float32", expert_parallel_size=2)
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
out = llm.generate([[5, 17, 42, 99, 7, 23, 11]], params)[0].token_ids
llm.shutdown()
json.dump({"tokens": out, "experts": llm.target.model.layers[0].mlp.experts.num_experts},
          sys.stdout)
