"""Peer engines on the same weights, for side-by-side benchmarks."""

from __future__ import annotations

import time

import torch

from specmoe.loader.aliases import resolve_model_path
from specmoe.loader.hf_dir import iter_safetensors, read_hf_config


def load_transformers_model(model: str, dtype: torch.dtype):
    """A transformers causal LM with exactly the weights our loader reads for `model`
    (HF directory, GGUF file or alias): a GGUF is dequantised by our GGUF reader and its
    tensors, already under HuggingFace names, go into `AutoModelForCausalLM.from_config`.

    Raises:
        ValueError: when transformers' model lacks or rejects a tensor.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    path = resolve_model_path(model)
    if path.is_file():
        from specmoe.loader.gguf_file import GGUFCheckpoint
        ckpt = GGUFCheckpoint(path)
        hf_config, tensors = ckpt.hf_config, ckpt.iter_tensors(dtype)
    else:
        hf_config, tensors = read_hf_config(path), iter_safetensors(path, dtype)
    config = AutoConfig.for_model(**hf_config)
    with torch.device("cpu"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(dict(tensors), strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"transformers model for {model}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def ours_generate(engine, ids: list[int], k: int, max_tokens: int) -> tuple[list[int], float]:
    """Greedy generation of exactly `max_tokens` tokens (EOS ignored) with our engine at K=k
    (0: no speculation). Returns (token ids, wall seconds)."""
    from specmoe.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                        num_speculative_tokens=k)
    t = time.perf_counter()
    out = engine.generate([ids], sp)[0]
    return out.token_ids, time.perf_counter() - t


@torch.inference_mode()
def hf_generate(model, ids: list[int], max_tokens: int, **kwargs) -> tuple[list[int], float]:
    """Greedy transformers `generate` of exactly `max_tokens` tokens (EOS suppressed until
    then). Returns (new token ids, wall seconds). kwargs go to `generate` (for example
    `assistant_model=` or `prompt_lookup_num_tokens=`)."""
    x = torch.tensor([ids])
    t = time.perf_counter()
    y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                       max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
    return y[0, len(ids):].tolist(), time.perf_counter() - t
