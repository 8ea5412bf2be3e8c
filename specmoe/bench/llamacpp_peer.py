"""llama-cpp-python as a peer of `specmoe bench spec`: plain greedy decoding and its
prompt-lookup drafting (`LlamaPromptLookupDecoding`) on the same GGUF file our loader
dequantises, fed the same prompt token ids.

llama.cpp runs the file's quantised (Q4_K/Q5_0/...) tensors directly, while we and
transformers run their bf16 dequantisation, so greedy outputs may differ.

llama-cpp-python is not a package dependency: it is built from source by `make peers`
(without AMX instructions, which the benchmark machines forbid).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from specmoe.loader.aliases import resolve_model_path

LLAMA_CPP_VERSION = "0.3.36"
N_THREADS = 2                # the cores of the machines these benchmarks run on (PEERS.md)
INSTALL_HINT = (f"the llama-cpp peer needs llama-cpp-python=={LLAMA_CPP_VERSION}, which is "
                "not installed or does not load: run `make peers` (it builds it into the "
                "virtual environment, about 9 minutes)")


class PeerUnavailableError(ValueError):
    """A requested peer cannot run here (its package is missing). A ValueError, so the CLI
    reports it as a bad option instead of a traceback."""


def import_llama_cpp():
    """The `llama_cpp` module.

    Raises:
        PeerUnavailableError: naming `make peers`, when it is missing or does not load.
    """
    try:
        import llama_cpp
        import llama_cpp.llama_speculative  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:  # RuntimeError: libllama failed
        raise PeerUnavailableError(f"{INSTALL_HINT} ({exc})") from exc
    return llama_cpp


def load_llama(model: str, n_ctx: int, prompt_lookup_tokens: int = 0,
               n_threads: int = N_THREADS):
    """A `llama_cpp.Llama` on the GGUF file behind `model` (path or alias), with
    prompt-lookup drafting of `prompt_lookup_tokens` tokens when that is > 0.

    Raises:
        PeerUnavailableError: llama-cpp-python is missing.
        ValueError: `model` is not a GGUF file.
    """
    llama_cpp = import_llama_cpp()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    path = resolve_model_path(model)
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"the llama-cpp peer needs a .gguf model, not {path}")
    draft = (LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup_tokens)
             if prompt_lookup_tokens > 0 else None)
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=n_threads,
                           n_threads_batch=n_threads, draft_model=draft, seed=0,
                           verbose=False)


def ban_tokens(token_ids: Iterable[int]) -> Callable:
    """A llama-cpp-python logits processor that sets the logits of `token_ids` to -inf."""
    import numpy as np
    banned = np.array(sorted(token_ids), dtype=np.intp)

    def processor(input_ids, scores):
        scores[banned] = -np.inf
        return scores
    return processor


def llama_generate(llm, ids: list[int], max_tokens: int,
                   eos_token_ids: Iterable[int]) -> tuple[list[int], float]:
    """Greedy generation of exactly `max_tokens` tokens after the prompt `ids` (token ids,
    no tokenisation), the end-of-sequence ids banned, as transformers' `min_new_tokens` does
    for the transformers peers. Every call prefills its whole prompt: no KV-cache reuse
    from an earlier call. Returns (new token ids, wall seconds)."""
    from llama_cpp import LogitsProcessorList
    processors = LogitsProcessorList([ban_tokens(eos_token_ids)])
    llm.reset()  # forget the previous sequence, so generate() skips its prefix matching
    out: list[int] = []
    t = time.perf_counter()
    if max_tokens > 0:
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                  repeat_penalty=1.0, logits_processor=processors):
            out.append(token)
            if len(out) == max_tokens:
                break
    return out, time.perf_counter() - t


def llamacpp_modes(model: str, prompts: list[list[int]], max_tokens: int,
                   eos_token_ids: Iterable[int], prompt_lookup_tokens: int
                   ) -> dict[str, Callable[[list[int]], tuple[list[int], float]]]:
    """"llama-cpp plain" and "llama-cpp prompt lookup": functions of a prompt's token ids
    returning (new token ids, seconds). Each mode has its own `Llama` (the prompt-lookup
    one keeps logits of every position) with a context that fits the longest prompt, and
    has run once (2 tokens) so that paging in the weights is not timed."""
    eos = sorted(eos_token_ids)
    n_ctx = max(len(p) for p in prompts) + max_tokens + prompt_lookup_tokens + 1
    modes = {}
    for name, lookup in (("llama-cpp plain", 0), ("llama-cpp prompt lookup",
                                                   prompt_lookup_tokens)):
        llm = load_llama(model, n_ctx, lookup)
        llama_generate(llm, prompts[0], min(2, max_tokens), eos)
        modes[name] = (lambda llm: lambda ids: llama_generate(llm, ids, max_tokens, eos))(llm)
    return modes
