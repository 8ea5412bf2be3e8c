"""Speculative speedup synthesis from measured verification cost and acceptance length.

With K drafts per step, a step emits AL(K) tokens on average (the mean acceptance length,
bonus token included) and costs one target forward over K + 1 tokens plus K draft forwards,
against one target forward per token without speculation. In units of Tt(B, 1):

    S(B, K) = AL(K) / (Tt(B, K + 1) / Tt(B, 1) + K Td(B, 1) / Tt(B, 1))

(Leviathan et al. 2023, arXiv 2211.17192, section 3.4, with the measured verification ratio in
place of their constant-cost assumption, as in MoESD, Huang et al. 2025, arXiv 2505.19645).
The second term is the draft cost ratio.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

BUNDLED_ACCEPTANCE = "acceptance_qwen2.5-coder.json"


def load_acceptance_lengths(path: str | Path | None = None, proposer: str = "draft",
                            group: str = "all", temperature: float = 0.0) -> dict[int, float]:
    """K -> mean acceptance length AL(K), from a `specmoe bench spec` results.json, or (path
    None) from the bundled figures of our Qwen2.5-Coder 0.5B -> 1.5B run.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file has no rows for (proposer, group, temperature).
    """
    if path is None:
        text = resources.files("specmoe.analysis.data").joinpath(BUNDLED_ACCEPTANCE).read_text()
        groups = json.loads(text)["mean_acceptance_length"].get(proposer, {})
        if group not in groups:
            raise ValueError(f"no bundled acceptance lengths for proposer={proposer!r}, "
                             f"group={group!r}: groups are {sorted(groups)}")
        return {int(k): float(v) for k, v in groups[group].items()}
    rows = _bench_spec_rows(Path(path))
    out = {int(r["k"]): float(r["mean_acceptance_length"]) for r in rows
           if r.get("proposer") == proposer and r.get("group") == group
           and float(r.get("temperature", -1)) == temperature and int(r.get("k", 0)) > 0}
    if not out:
        groups = sorted({str(r.get("group")) for r in rows})
        raise ValueError(f"{path}: no bench spec rows for proposer={proposer!r}, "
                         f"group={group!r}, temperature={temperature} (groups: {groups})")
    return out


def _bench_spec_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"acceptance file {path} does not exist (or is not a file)")
    try:
        rows = json.loads(path.read_text()).get("rows")
    except (ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a `specmoe bench spec` results.json: {exc}") from exc
    if not isinstance(rows, list):
        raise ValueError(f"{path} has no 'rows' list: not a `specmoe bench spec` results.json")
    return [r for r in rows if isinstance(r, dict)]


def parse_acceptance_lengths(text: str) -> dict[int, float]:
    """"1=1.8,2=2.4" -> {1: 1.8, 2: 2.4}.

    Raises:
        ValueError: no pair, a malformed pair, a repeated K, K < 1, or AL not in [1, K + 1].
    """
    out: dict[int, float] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        try:
            k_text, al_text = pair.split("=")
            k, al = int(k_text), float(al_text)
        except ValueError as exc:
            raise ValueError(f"invalid acceptance length {pair!r}: expected K=AL, e.g. "
                             "4=3.1") from exc
        if k < 1 or not 1.0 <= al <= k + 1:
            raise ValueError(f"invalid acceptance length {pair!r}: need K >= 1 and "
                             "1 <= AL <= K + 1")
        if k in out:
            raise ValueError(f"acceptance length for K={k} given twice")
        out[k] = al
    if not out:
        raise ValueError(f"no acceptance lengths in {text!r}: expected K=AL pairs, e.g. "
                         "1=1.8,4=3.3")
    return out


def speedup(acceptance_length: float, verify_ratio: float, draft_ratio: float) -> float:
    """S = AL / (Tt(B, K+1)/Tt(B, 1) + K Td/Tt)."""
    return acceptance_length / (verify_ratio + draft_ratio)


def speedup_table(tt: dict[tuple[int, int], float], td: dict[int, float] | None,
                  acceptance: dict[int, float], draft_cost_ratio: float | None = None
                  ) -> dict:
    """S(B, K) for every B with Tt(B, 1) and every K with AL(K) and Tt(B, K + 1).

    Args:
        tt: (B, T) -> Tt seconds.
        td: B -> Td(B, 1) draft forward seconds (None: use draft_cost_ratio).
        acceptance: K -> AL(K).
        draft_cost_ratio: Td/Tt per draft token, used when td is None (0: free drafts,
            as n-gram prompt lookup nearly is).
    Returns:
        {"rows": [{B, K, AL, verify_ratio, draft_ratio, speedup}], "best": {B: {K, speedup}},
         "breakeven_batch_size": smallest B whose best speedup < 1, or None}.
    """
    rows, best = [], {}
    for b in sorted({b for b, _ in tt}):
        if (b, 1) not in tt:
            continue
        for k, al in sorted(acceptance.items()):
            if (b, k + 1) not in tt:
                continue
            ratio = tt[b, k + 1] / tt[b, 1]
            per_draft = td[b] / tt[b, 1] if td is not None else float(draft_cost_ratio or 0.0)
            s = speedup(al, ratio, k * per_draft)
            rows.append({"B": b, "K": k, "AL": al, "verify_ratio": ratio,
                         "draft_ratio": k * per_draft, "speedup": s})
            if b not in best or s > best[b]["speedup"]:
                best[b] = {"K": k, "speedup": s}
    losing = [b for b, v in best.items() if v["speedup"] < 1.0]
    return {"rows": rows, "best": best, "breakeven_batch_size": min(losing) if losing else None}
