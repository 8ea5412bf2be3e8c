"""Run under torchrun by tests/engine/test_expert_parallel_engine.py: every rank runs this
same script (argv: the dispatch mode and the placement, contiguous or a file); rank 0 prints
the greedy tokens of tiny-moe under expert_parallel_size=2, its expert count and the
placement (ranks > 0 serve as workers inside LLM(...) and exit there)."""

import json
import sys

from specmoe import LLM, SamplingParams

dispatch, placement = sys.argv[1:] or ["replicated", "contiguous"]
llm = LLM("tiny-moe", dtype="float32", expert_parallel_size=2,
          expert_parallel_dispatch=dispatch, expert_placement=placement)
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
out = llm.generate([[5, 17, 42, 99, 7, 23, 11]], params)[0].token_ids
llm.shutdown()
json.dump({"tokens": out, "experts": llm.target.model.layers[0].mlp.experts.num_experts,
           "placement": list(llm.target.expert_map.placement)}, sys.stdout)
