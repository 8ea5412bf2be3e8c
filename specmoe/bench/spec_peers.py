"""Peers for `specmoe bench spec`: transformers' plain, assisted (same draft model) and
prompt-lookup generation on the same weights and prompts, interleaved with ours."""

from __future__ import annotations

import torch

from specmoe.bench.peers import hf_generate, load_transformers_model, ours_generate

PEERS = ("transformers",)
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value


def best_greedy_k(rows: list[dict], proposer: str = "draft") -> int:
    """The K with the highest greedy speedup over all groups."""
    cands = [r for r in rows if r["group"] == "all" and r["proposer"] == proposer
             and r["temperature"] == 0]
    return max(cands, key=lambda r: r["speedup"])["k"]


def _ours(engine, ids: list[int], k: int, max_tokens: int) -> float:
    tokens, seconds = ours_generate(engine, ids, k, max_tokens)
    return len(tokens) / seconds


def _hf(model, ids: list[int], max_tokens: int, **kwargs) -> float:
    tokens, seconds = hf_generate(model, ids, max_tokens, **kwargs)
    return len(tokens) / seconds


def run_peers(cfg, engines: dict, prompts, rows: list[dict]) -> dict:
    """Tokens/s of each mode on the prompts of the first dataset, greedy, and our ratio to
    each peer (median over prompts of per-prompt ratios, all modes run back to back)."""
    unknown = set(cfg.peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}: supported are {PEERS}")
    k = best_greedy_k(rows) if "draft" in engines else 0
    dtype = getattr(torch, cfg.dtype)
    target = load_transformers_model(cfg.target, dtype)
    assistant = load_transformers_model(cfg.draft, dtype)
    assistant.generation_config.num_assistant_tokens = max(k, 1)
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    group = prompts[0].group
    modes = {
        "ours plain": lambda ids: _ours(engines["plain"], ids, 0, cfg.max_tokens),
        f"ours draft K={k}": lambda ids: _ours(engines["draft"], ids, k, cfg.max_tokens),
        "transformers plain": lambda ids: _hf(target, ids, cfg.max_tokens),
        "transformers assisted": lambda ids: _hf(target, ids, cfg.max_tokens,
                                                 assistant_model=assistant),
        "transformers prompt lookup": lambda ids: _hf(
            target, ids, cfg.max_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
    }
    if "draft" not in engines:
        modes.pop(f"ours draft K={k}")
    per_prompt = {m: [] for m in modes}
    for p in [p for p in prompts if p.group == group]:
        for name, fn in modes.items():
            per_prompt[name].append(fn(p.token_ids))
    return {"group": group, "k": k, "tokens_per_s": per_prompt,
            "ratios": _ratios(per_prompt)}


def _ratios(per_prompt: dict[str, list[float]]) -> dict[str, float]:
    import statistics
    ours = [m for m in per_prompt if m.startswith("ours")]
    peers = [m for m in per_prompt if not m.startswith("ours")]
    return {f"{o} / {p}": statistics.median(a / b for a, b in zip(per_prompt[o], per_prompt[p]))
            for o in ours for p in peers}
