"""Peers for `specmoe bench spec`, on the same weights and prompts, interleaved with ours:
transformers' plain, assisted (same draft model) and prompt-lookup generation on the bf16
dequantised weights, and llama-cpp-python's plain and prompt-lookup decoding on the GGUF
file itself (`make peers` installs it)."""

from __future__ import annotations

import statistics

import torch

from specmoe.bench.peers import hf_generate, load_transformers_model, ours_generate

PEERS = ("transformers", "llama-cpp")
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value, also used for llama.cpp
# Greedy outputs compared token for token: (mode, reference mode).
COMPARISONS = (("llama-cpp plain", "ours plain"),)


def check_peers(peers: list[str]) -> None:
    """Fail before any measurement on an unknown peer or a peer that cannot run here.

    Raises:
        ValueError: an unknown peer name.
        PeerUnavailableError (a ValueError): llama-cpp-python is missing; names `make peers`.
    """
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}: supported are {', '.join(PEERS)}")
    if "llama-cpp" in peers:
        from specmoe.bench.llamacpp_peer import import_llama_cpp
        import_llama_cpp()


def best_greedy_k(rows: list[dict], proposer: str = "draft") -> int:
    """The K with the highest greedy speedup over all groups."""
    cands = [r for r in rows if r["group"] == "all" and r["proposer"] == proposer
             and r["temperature"] == 0]
    return max(cands, key=lambda r: r["speedup"])["k"]


def _transformers_modes(cfg, k: int) -> dict:
    dtype = getattr(torch, cfg.dtype)
    target = load_transformers_model(cfg.target, dtype)
    assistant = load_transformers_model(cfg.draft, dtype)
    assistant.generation_config.num_assistant_tokens = max(k, 1)
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return {
        "transformers plain": lambda ids: hf_generate(target, ids, cfg.max_tokens),
        "transformers assisted": lambda ids: hf_generate(target, ids, cfg.max_tokens,
                                                         assistant_model=assistant),
        "transformers prompt lookup": lambda ids: hf_generate(
            target, ids, cfg.max_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
    }


def run_peers(cfg, engines: dict, prompts, rows: list[dict]) -> dict:
    """Tokens/s of each mode on the prompts of the first dataset, greedy, exactly
    `cfg.max_tokens` tokens each, and our ratio to each peer (median over prompts of
    per-prompt ratios, all modes run back to back per prompt). Peers ban the end-of-sequence
    token until then; ours emits it and goes on (ignore_eos). `greedy_comparison` counts the
    prompts whose greedy output differs between the pairs of COMPARISONS that ran."""
    check_peers(cfg.peers)
    k = best_greedy_k(rows) if "draft" in engines else 0
    group = prompts[0].group
    group_ids = [p.token_ids for p in prompts if p.group == group]
    modes = {"ours plain": lambda ids: ours_generate(engines["plain"], ids, 0, cfg.max_tokens)}
    if "draft" in engines:
        modes[f"ours draft K={k}"] = lambda ids: ours_generate(engines["draft"], ids, k,
                                                               cfg.max_tokens)
    if "transformers" in cfg.peers:
        modes |= _transformers_modes(cfg, k)
    if "llama-cpp" in cfg.peers:
        from specmoe.bench.llamacpp_peer import llamacpp_modes
        modes |= llamacpp_modes(cfg.target, group_ids, cfg.max_tokens,
                                engines["plain"].processor.eos_token_ids, PROMPT_LOOKUP_TOKENS)
    per_prompt: dict[str, list[float]] = {m: [] for m in modes}
    outputs: dict[str, list[list[int]]] = {m: [] for m in modes}
    for ids in group_ids:
        for name, fn in modes.items():
            tokens, seconds = fn(ids)
            per_prompt[name].append(len(tokens) / seconds)
            outputs[name].append(list(tokens))
    result = {"group": group, "k": k, "tokens_per_s": per_prompt,
              "ratios": _ratios(per_prompt)}
    comparisons = compare_outputs(outputs, COMPARISONS)
    if comparisons:
        result["greedy_comparison"] = comparisons
    return result


def compare_outputs(outputs: dict[str, list[list[int]]],
                    pairs: tuple[tuple[str, str], ...]) -> dict[str, dict]:
    """For each (mode, reference) pair present in `outputs` (mode -> token ids per prompt):
    the number of prompts whose tokens differ and, per prompt, the index of the first
    differing token (None where equal)."""
    out = {}
    for mode, ref in pairs:
        if mode not in outputs or ref not in outputs:
            continue
        first = [_first_difference(a, b) for a, b in zip(outputs[mode], outputs[ref])]
        out[f"{mode} vs {ref}"] = {"differing_prompts": sum(f is not None for f in first),
                                   "num_prompts": len(first), "first_difference": first}
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratios(per_prompt: dict[str, list[float]]) -> dict[str, float]:
    ours = [m for m in per_prompt if m.startswith("ours")]
    peers = [m for m in per_prompt if not m.startswith("ours")]
    return {f"{o} / {p}": statistics.median(a / b for a, b in zip(per_prompt[o], per_prompt[p]))
            for o in ours for p in peers}
