"""Load a GGUF file with float32 activations (and int4 weights if asked), then time 8
greedy tokens after a warm-up generation.

    python olmoe_run.py FILE.gguf [int4]
"""
import sys, time
from specmoe import LLM, SamplingParams
from specmoe.utils.progress import StderrProgress, reporting
t0 = time.perf_counter()
with reporting(StderrProgress()):
    llm = LLM(sys.argv[1], dtype="float32", quantization=sys.argv[2] if len(sys.argv) > 2 else None,
              scheduler={"kv_cache_memory_bytes": 256 << 20})
load_s = time.perf_counter() - t0
m = llm.target.model
final = sum(t.nbytes for t in (*m.parameters(), *m.buffers()))
print(f"loaded in {load_s:.1f} s, final weights {final / 2**30:.2f} GiB", flush=True)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = llm.generate("The history of the", params)[0]
t = time.perf_counter()
out = llm.generate("The history of the", params)[0]
print(f"decode {len(out.token_ids)} tokens in {time.perf_counter() - t:.1f} s "
      f"({out.metrics.decode_tokens_per_s(len(out.token_ids)):.2f} tok/s)")
