"""Quality of the KV cache dtypes on one target: held-out perplexity and greedy agreement.

    python quality.py TARGET.gguf [NUM_WINDOWS] [WINDOW] [MAX_TOKENS]

The target runs at its file's blocks (`quantization="gguf"`), once per cache dtype
(float32, bfloat16, int8), one load each. Perplexity: NUM_WINDOWS held-out windows of
WINDOW tokens from the repository's corpus (`carve.calibration`), fed 16 tokens per forward
(decode-sized forwards: every row attends the cache through the native kernel), next-token
NLL over every position but the first. Agreement: greedy continuations of MAX_TOKENS tokens on
the spec-bench questions (one per category, chat template), each compared with the float32
and bfloat16 caches' continuations: identical continuations and tokens before the first
difference. Prints one JSON line per dtype, then one JSON line of comparisons.
"""
import json
import math
import sys
import time

import torch

from specmoe import LLM
from specmoe.carve import calibration
from specmoe.layers.paged_attention import MAX_DECODE_QUERY
from specmoe.sampling_params import SamplingParams
from specmoe.utils.data import one_per_category
from specmoe.worker.model_runner import SequenceInput

DTYPES = ("float32", "bfloat16", "int8")
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities", "translation", "summarization", "qa", "math_reasoning", "rag")


def window_nll(runner, window: torch.Tensor, kv_cache_dtype: str) -> tuple[float, int]:
    """Summed next-token NLL of one window and the positions it covers."""
    ids = window.tolist()
    block = 16
    cache = runner.new_paged_cache(-(-len(ids) // block), block, kv_cache_dtype)
    blocks = list(range(cache.num_blocks))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, MAX_DECODE_QUERY):
        chunk = ids[start:start + MAX_DECODE_QUERY]
        logits = runner.execute(cache, [SequenceInput(chunk, start, blocks, len(chunk))])
        targets = torch.tensor(ids[start + 1:start + 1 + len(chunk)])
        logp = torch.log_softmax(logits[:len(targets)].float(), dim=-1)
        nll -= float(logp.gather(1, targets[:, None]).sum())
        count += len(targets)
    return nll, count


def prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    target = sys.argv[1]
    num_windows = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    outputs = {}
    for dtype in DTYPES:
        llm = LLM(target, quantization="gguf", kv_cache_dtype=dtype)
        corpus = calibration.split_corpus(calibration.default_corpus_dir())
        windows = calibration.windows(llm.tokenizer, corpus.held_out, num_windows, width, 0)
        t0 = time.perf_counter()
        nll, count = map(sum, zip(*(window_nll(llm.target, w, dtype) for w in windows)))
        ppl_s = time.perf_counter() - t0
        prompts = [llm.chat_prompt([{"role": "user", "content": q.text}])
                   for q in one_per_category("spec_bench", list(CATEGORIES))]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        outputs[dtype] = [o.token_ids for o in outs]
        print(json.dumps({"kv_cache_dtype": dtype, "perplexity": round(math.exp(nll / count), 4),
                          "nll_per_token": round(nll / count, 5), "positions": count,
                          "ppl_seconds": round(ppl_s, 1), "summary": llm.kv_cache_summary()}),
              flush=True)
        del llm
    compare = {}
    for dtype, ref in (("bfloat16", "float32"), ("int8", "float32"), ("int8", "bfloat16")):
        pairs = list(zip(outputs[dtype], outputs[ref]))
        compare[f"{dtype}_vs_{ref}"] = {
            "identical": sum(a == b for a, b in pairs), "prompts": len(pairs),
            "tokens_before_first_difference": [prefix_len(a, b) for a, b in pairs],
            "tokens": [len(a) for a, _ in pairs]}
    print(json.dumps(compare))


if __name__ == "__main__":
    main()
