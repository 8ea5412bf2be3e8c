"""Measured expert load for `specmoe expert-placement`: per-expert token counts from running
a MoE model on prompts, or from a scrape of a running server's /metrics, summed over MoE
layers into the load a balanced `ExpertMap` is built from (`layers.moe.placement`)."""

from __future__ import annotations

from specmoe.layers.moe.backends import expert_stats, moe_blocks
from specmoe.layers.moe.stats import ExpertLoadRecorder
from specmoe.sampling_params import SamplingParams

EXPERT_LOAD_SAMPLE = "specmoe:moe_expert_load_total"


def measure_expert_load(llm, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    """(token, slot) pairs routed to each expert, per MoE layer, while `llm` prefills
    `prompts` (token ids) and decodes `max_tokens` greedy tokens for each (EOS ignored).

    Returns:
        layer index -> [num_experts] counts.
    Raises:
        ValueError: a dense model (no MoE layer).
    """
    model = llm.target.model
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{llm.config.model.model} has no MoE layer: no expert load to "
                         "measure")
    recorder = ExpertLoadRecorder(blocks[0].router.num_experts)
    with expert_stats(model).subscribed(recorder):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                             ignore_eos=True))
    return recorder.take()


def load_from_metrics(text: str, num_experts: int | None = None) -> dict[int, list[int]]:
    """The per-layer, per-expert counts of a /metrics scrape (Prometheus text): the samples
    of `specmoe:moe_expert_load_total{layer,expert}` (`serve` records one engine step in 16),
    summed over model names.

    Args:
        text: the scraped exposition text.
        num_experts: N; None: the highest expert id seen + 1 (an expert never routed to has
            no sample, so pass N when the last experts may be idle).
    Returns:
        layer index -> [num_experts] counts.
    Raises:
        ValueError: text that does not parse, no such sample, or an expert id >= num_experts.
    """
    from prometheus_client.parser import text_string_to_metric_families
    counts: dict[tuple[int, int], float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == EXPERT_LOAD_SAMPLE:
                    key = (int(s.labels["layer"]), int(s.labels["expert"]))
                    counts[key] = counts.get(key, 0.0) + s.value
    except (ValueError, KeyError) as exc:
        raise ValueError(f"not Prometheus metrics with {EXPERT_LOAD_SAMPLE}: {exc}") from None
    if not counts:
        raise ValueError(f"no {EXPERT_LOAD_SAMPLE} sample: scrape /metrics of `specmoe serve` "
                         "on a MoE model after it has served requests")
    seen = max(e for _, e in counts) + 1
    n = seen if num_experts is None else num_experts
    if seen > n:
        raise ValueError(f"the metrics name expert {seen - 1}, but num_experts={n}")
    out: dict[int, list[int]] = {}
    for (layer, expert), value in sorted(counts.items()):
        out.setdefault(layer, [0] * n)[expert] += int(value)
    return out


def sum_over_layers(counts: dict[int, list[int]]) -> list[int]:
    """Per-expert load summed over MoE layers (the one map serves every layer).

    Raises:
        ValueError: no layer, or layers with different expert counts.
    """
    widths = {len(c) for c in counts.values()}
    if len(widths) != 1:
        raise ValueError(f"per-layer expert counts of widths {sorted(widths)}: need one N")
    return [sum(col) for col in zip(*counts.values())]


def prompt_ids(llm, texts: list[str]) -> list[list[int]]:
    """Each text as one user message in the model's chat template (raw without one)."""
    from specmoe.bench.throughput import chat_ids
    return [chat_ids(llm, t) for t in texts]
