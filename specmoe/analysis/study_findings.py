"""The findings of `specmoe study`, in plain words, computed from its measured figures, and
the figures they compare (`finding_tokens`, `verification_ratio`), which report.md's tables
use too: `study_report` imports this module, never the reverse."""

from __future__ import annotations

from specmoe.analysis.cost_model import PREDICTED

NON_MONOTONIC_MARGIN = 0.03  # a rise then a fall of at least 3% counts as non-monotonic
FINDING_K = 4  # the K whose verification ratio Tt(B, K+1)/Tt(B, 1) the findings compare


def finding_tokens(presets: dict[str, dict]) -> int:
    """The T the findings compare: the largest measured T <= FINDING_K + 1 above 1, else the
    smallest measured T above 1."""
    ts = sorted({p["T"] for res in presets.values() for p in res["points"] if p["T"] > 1})
    below = [t for t in ts if t <= FINDING_K + 1]
    return below[-1] if below else ts[0]


def verification_ratio(res: dict, batch_size: int, num_tokens: int,
                       key: str = "min_s") -> float | None:
    """Tt(B, T) / Tt(B, 1) of one preset's measured points (`res["points"]`, dicts with "B",
    "T" and `key`, seconds): the cost of verifying T tokens per request relative to a
    one-token step at batch size B, or None when (B, T) or (B, 1) was not measured."""
    pts = {(p["B"], p["T"]): p for p in res["points"]}
    if (batch_size, num_tokens) not in pts or (batch_size, 1) not in pts:
        return None
    return pts[batch_size, num_tokens][key] / pts[batch_size, 1][key]


def sparsity(preset: dict) -> float:
    """k/N of a preset (`dataclasses.asdict` of a `Preset`, as results.json holds it): the
    share of routed experts one token runs (0.0 for dense)."""
    return preset["top_k"] / preset["num_experts"] if preset["num_experts"] else 0.0


def shape_extras(preset: dict) -> list[str]:
    """What a preset has beyond Llama-style attention and routed experts alone, in words
    (DeepSeek's MLA, shared experts, dense first layers); empty for the others and for
    results.json files written before these fields existed."""
    out = ["MLA attention"] if preset.get("mla") else []
    shared, dense = preset.get("shared_experts", 0), preset.get("first_dense_layers", 0)
    if shared:
        out.append(f"{shared} shared expert" + "s" * (shared > 1))
    if dense:
        out.append(f"{dense} dense first layer" + "s" * (dense > 1))
    return out


def findings(r: dict) -> list[str]:
    """Bullet lines: verification flatness MoE vs dense and across the MoE presets' k/N,
    the speedup's shape against B, where speculation stops paying, cost-model accuracy, and
    learned-routing overlap."""
    presets = r["presets"]
    moe = [n for n, res in presets.items() if res["preset"]["num_experts"]]
    dense = [n for n in presets if n not in moe]
    out = _flatness(presets, moe, dense)
    out += _sparsity_lines(presets, moe)
    out += _speedup_shape(r["speedup"], moe, dense)
    out += _model_accuracy(r["cost_model"])
    e2e = r.get("e2e")
    if e2e:
        rows = ", ".join(f"B={x['B']} {x['measured_speedup']:.2f}x measured vs "
                         f"{x['predicted_speedup']:.2f}x predicted" for x in e2e["rows"])
        out.append(f"- End to end on {e2e['config']['model']} with its draft (K="
                   f"{e2e['config']['k']}): {rows}; median error "
                   f"{e2e['median_error']:.1%}.")
    lr = r.get("learned_routing")
    if lr:
        out += [f"- {lr['finding']}"]
    return out


def _flatness(presets: dict, moe: list[str], dense: list[str]) -> list[str]:
    batch_sizes = sorted({p["B"] for res in presets.values() for p in res["points"]})
    t = finding_tokens(presets)
    out = []
    for b in sorted({batch_sizes[0], batch_sizes[len(batch_sizes) // 2], batch_sizes[-1]}):
        parts = [f"{n} {verification_ratio(presets[n], b, t):.2f}x" for n in moe + dense
                 if verification_ratio(presets[n], b, t) is not None]
        out.append(f"- At B={b}, verifying K={t - 1} drafts (T={t}) costs "
                   + ", ".join(parts) + " of a one-token step.")
    if moe and dense and len(batch_sizes) > 1:
        out.append("- " + _rise_sentence(presets, moe + dense, batch_sizes, t))
        out += ["- " + _cheaper_sentence(presets, moe, d, batch_sizes, t) for d in dense]
    return out


def _sparsity_lines(presets: dict, moe: list[str]) -> list[str]:
    """Whether the sparser MoE (smaller k/N) keeps verification flatter: the MoE presets
    ordered by k/N, each one's verification ratio at the largest B and its rise from the
    smallest B, which preset rises least, and whether the rise grows with k/N."""
    batch_sizes = sorted({p["B"] for res in presets.values() for p in res["points"]})
    if len(batch_sizes) < 2 or len({sparsity(presets[n]["preset"]) for n in moe}) < 2:
        return []
    t, lo, hi = finding_tokens(presets), batch_sizes[0], batch_sizes[-1]
    order = sorted(moe, key=lambda n: sparsity(presets[n]["preset"]))
    at_hi = {n: verification_ratio(presets[n], hi, t) for n in order}
    rise = {n: at_hi[n] / verification_ratio(presets[n], lo, t) - 1 for n in order}
    parts = [f"{n} (k/N {sparsity(presets[n]['preset']):.1%}) {at_hi[n]:.2f}x, {rise[n]:+.0%}"
             for n in order]
    sparsest, flattest = order[0], min(order, key=rise.__getitem__)
    steady = all(rise[a] <= rise[b] for a, b in zip(order, order[1:]))
    verdict = (f"the sparsest, {sparsest}, keeps verification flattest" if flattest == sparsest
               else f"the sparsest, {sparsest}, does not keep verification flattest "
               f"({flattest} rises least)")
    verdict += ("; the rise grows with k/N across all of them" if steady
                else "; the rise does not grow steadily with k/N")
    extras = [f"{n} has {', '.join(shape_extras(presets[n]['preset']))}" for n in order
              if shape_extras(presets[n]["preset"])]
    note = (f" Sparsity is not the only difference: {'; '.join(extras)}." if extras else "")
    return [f"- By sparsity, smallest k/N first: verifying K={t - 1} drafts at B={hi} costs "
            + ", ".join(parts) + f" (the ratio, then its change from B={lo}): {verdict}."
            + note]


def _rise_sentence(presets: dict, names: list[str], batch_sizes: list[int], t: int) -> str:
    """How much the verification ratio grows from the smallest to the largest B."""
    lo, hi = batch_sizes[0], batch_sizes[-1]
    rise = {n: verification_ratio(presets[n], hi, t) / verification_ratio(presets[n], lo, t)
            for n in names}
    parts = [f"{n} {rise[n] - 1:+.0%}" for n in names]
    return (f"From B={lo} to B={hi} the ratio changes by " + ", ".join(parts)
            + ": the smaller the change in size, the flatter the curve (the ratios at the "
            "batch sizes between are in the table below).")


def _cheaper_sentence(presets: dict, moe: list[str], dense: str, batch_sizes: list[int],
                      t: int) -> str:
    """At which B every MoE preset verifies more cheaply (relative to its own one-token
    step) than one dense preset."""
    below = [b for b in batch_sizes
             if max(verification_ratio(presets[n], b, t) for n in moe)
             < verification_ratio(presets[dense], b, t)]
    if not below:
        return (f"At no batch size does every MoE preset verify relatively more cheaply than "
                f"{dense}.")
    if len(below) == len(batch_sizes):
        return f"Every MoE preset verifies relatively more cheaply than {dense} at every B."
    return (f"Every MoE preset verifies relatively more cheaply than {dense} at B = "
            f"{', '.join(map(str, below))}, not at the other batch sizes.")


def _speedup_shape(synthesis: dict, moe: list[str], dense: list[str]) -> list[str]:
    out = []
    for name in moe + dense:
        best = sorted((int(b), v["speedup"]) for b, v in synthesis[name]["best"].items())
        if not best:
            continue
        s = [v for _, v in best]
        shape = _shape(s, [b for b, _ in best])
        stop = synthesis[name]["breakeven_batch_size"]
        out.append(f"- {name}: best speedup {s[0]:.2f}x at B={best[0][0]}, {s[-1]:.2f}x at "
                   f"B={best[-1][0]}; against B it is {shape}; speculation "
                   + (f"stops paying at B={stop}." if stop else "pays at every B measured."))
    return out


def _shape(s: list[float], batch_sizes: list[int]) -> str:
    """Words for the shape of the best speedup against B."""
    peak = max(range(len(s)), key=s.__getitem__)
    margin = 1 + NON_MONOTONIC_MARGIN
    if 0 < peak < len(s) - 1 and s[peak] > margin * max(s[0], s[-1]):
        return (f"non-monotonic: it rises to a peak at B={batch_sizes[peak]} ({s[peak]:.2f}x) "
                "and falls after")
    if peak == 0:
        return "highest at the smallest batch size and lower at every larger one"
    if peak == len(s) - 1:
        return "highest at the largest batch size"
    return (f"roughly flat (its peak, {s[peak]:.2f}x at B={batch_sizes[peak]}, is within 3% "
            "of an end)")


def _model_accuracy(fit: dict) -> list[str]:
    e = fit["errors"]
    ours, amdahl = e["all"]["cost_model"]["median"], e["verification (T>=2)"]["amdahl"]["median"]
    if PREDICTED in e:
        held_out = e[PREDICTED]["cost_model"]["median"]
        verdict = ("meets the 10% target on both" if max(ours, held_out) <= 0.10 else
                   "misses the 10% target" + (" on the predicted points" if ours <= 0.10
                                              else ""))
        scored = (f"{held_out:.1%} over the points it did not fit ({PREDICTED}): it "
                  f"{verdict}")
    else:
        scored = ("the grid has no point it did not fit (every T is among those fitted), "
                  "so it predicted nothing here")
    out = [f"- The cost model's median error is {ours:.1%} over the whole grid and "
           f"{scored}. The Amdahl-style estimate's median error on the verification points "
           f"is {amdahl:.1%} (at T = 1 it is exact by construction)."]
    zero = [k for k, v in fit["coefficients"].items() if v == 0.0]
    if zero:
        out.append(f"- The fit set these cost-model terms to zero: {', '.join(zero)} (they "
                   "did not help explain the fitted timings on this machine).")
    return out


# A point's repetitions spread more than this (max / min - 1): the machine was busy.
NOISY_SPREAD = 0.25
# A cost model this far off (median relative error) describes the noise, not the machine.
NOISY_MODEL_ERROR = 0.15


def measurement_warnings(presets: dict[str, dict], fit: dict) -> list[str]:
    """Warnings for figures no machine can produce or that noise decided: verifying T > 1
    tokens measured cheaper than 1 (Tt(B, T) / Tt(B, 1) < 1), repetitions that spread by
    more than NOISY_SPREAD, and a cost model off by more than NOISY_MODEL_ERROR."""
    out = []
    for name, res in presets.items():
        for p in res["points"]:
            ratio = verification_ratio(res, p["B"], p["T"]) if p["T"] > 1 else None
            if ratio is not None and ratio < 1:
                out.append(f"{name}: Tt({p['B']}, {p['T']}) / Tt({p['B']}, 1) = {ratio:.2f} "
                           f"< 1, verifying {p['T']} tokens measured cheaper than 1: noise; "
                           "rerun with more --reps on a quiet machine")
        spread = [(p, max(p["seconds"]) / min(p["seconds"]) - 1) for p in res["points"]
                  if len(p.get("seconds", ())) > 1]
        noisy = [(p, s) for p, s in spread if s > NOISY_SPREAD]
        if noisy:
            p, s = max(noisy, key=lambda x: x[1])
            out.append(f"{name}: {len(noisy)} of {len(res['points'])} points spread by more "
                       f"than {NOISY_SPREAD:.0%} over their repetitions (worst: B={p['B']}, "
                       f"T={p['T']}, {s:.0%}): the machine was busy")
    error = fit.get("errors", {}).get("all", {}).get("cost_model", {}).get("median")
    if error is not None and error > NOISY_MODEL_ERROR:
        out.append(f"the cost model's median error is {error:.0%} (above "
                   f"{NOISY_MODEL_ERROR:.0%}): its predictions fit the noise, not the machine")
    return out
