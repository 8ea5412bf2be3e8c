"""`specmoe bench spec` bookkeeping on hand-made runs: aggregation, speedups against the
same-run plain baseline, acceptance statistics, the report and its plots."""

from __future__ import annotations

import json

import pytest

from specmoe.bench.report import best_table, write_report
from specmoe.bench.roofline import weight_bytes_per_token
from specmoe.bench.spec import aggregate
from specmoe.bench.spec_peers import best_greedy_k


def _run(group, proposer, k, temp, tokens, seconds, drafts=0, drafted=0, accepted=0,
         per_pos=(), match=True):
    r = {"group": group, "proposer": proposer, "k": k, "temperature": temp,
         "num_tokens": tokens, "seconds": seconds, "decode_seconds": seconds,
         "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted": accepted,
         "accepted_per_position": list(per_pos), "draft_seconds": 0.0,
         "verify_seconds": 0.0, "token_ids": [1] * tokens}
    if proposer != "none" and temp == 0:
        r["matches_plain"] = match
    return r


@pytest.fixture
def runs():
    return [
        _run("humaneval", "none", 0, 0.0, 64, 8.0),
        _run("humaneval", "draft", 2, 0.0, 64, 4.0, drafts=20, drafted=40, accepted=30,
             per_pos=(18, 12)),
        _run("humaneval", "draft", 4, 0.0, 64, 2.0, drafts=16, drafted=64, accepted=48,
             per_pos=(15, 13, 11, 9), match=False),
        _run("gsm8k", "none", 0, 0.0, 64, 16.0),
        _run("gsm8k", "draft", 2, 0.0, 64, 16.0, drafts=30, drafted=60, accepted=6,
             per_pos=(5, 1)),
        _run("gsm8k", "draft", 4, 0.0, 64, 32.0, drafts=30, drafted=120, accepted=6,
             per_pos=(4, 1, 1, 0)),
    ]


def _row(rows, group, k):
    return next(r for r in rows if r["group"] == group and r["k"] == k
                and r["proposer"] == "draft")


def test_aggregate_speedups_and_acceptance(runs):
    rows = aggregate(runs)
    he = _row(rows, "humaneval", 4)
    assert he["tokens_per_s"] == pytest.approx(32.0)
    assert he["speedup"] == pytest.approx(4.0)          # 32 tok/s vs plain 8 tok/s
    assert he["acceptance_rate"] == pytest.approx(48 / 64)
    assert he["mean_acceptance_length"] == pytest.approx(1 + 48 / 16)
    assert he["acceptance_per_position"] == pytest.approx([15 / 16, 13 / 16, 11 / 16, 9 / 16])
    assert he["greedy_mismatches"] == 1
    assert _row(rows, "gsm8k", 4)["speedup"] == pytest.approx(0.5)
    # "all" pools tokens and seconds: plain 128 tok / 24 s, draft K=2 128 tok / 20 s.
    assert _row(rows, "all", 2)["speedup"] == pytest.approx((128 / 20) / (128 / 24))


def test_best_k_and_report(runs, tmp_path):
    rows = aggregate(runs)
    assert best_greedy_k(rows) == 2  # pooled: K=2 1.2x beats K=4 (128 tok / 34 s) 0.94x
    table = "\n".join(best_table(rows))
    assert "| humaneval | draft | 4 | 4.00x |" in table
    assert "| gsm8k | draft | 2 | 1.00x |" in table
    results = {"config": {"target": "t", "draft": "d", "draft_quantization": "int4",
                          "dtype": "bfloat16", "max_tokens": 64, "num_prompts": 1},
               "total_seconds": 60.0, "rows": rows, "runs": runs,
               "roofline": {"read_bandwidth_gb_s": 25.0, "weight_bytes_per_token": 2.5e9,
                            "roofline_tokens_per_s": 10.0, "plain_decode_tokens_per_s": 8.5,
                            "fraction_of_roofline": 0.85}}
    paths = write_report(results, tmp_path / "report")
    names = sorted(p.name for p in paths)
    assert names == ["acceptance_length_vs_k.png", "report.md", "results.json",
                     "speedup_vs_k.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert "85% of it" in (tmp_path / "report" / "report.md").read_text()
    assert json.loads((tmp_path / "report" / "results.json").read_text())["rows"]


def test_weight_bytes_skip_embedding_but_count_tied_head():
    import torch
    from specmoe.config import ArchConfig
    from specmoe.models.decoder import DecoderModel
    kw = dict(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=8,
              intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
              max_position_embeddings=32)
    untied = DecoderModel(ArchConfig(**kw), 32)
    tied = DecoderModel(ArchConfig(**kw, tie_word_embeddings=True), 32)
    embed = 100 * 8 * 4
    total = sum(p.numel() * 4 for p in untied.parameters())
    assert weight_bytes_per_token(untied) == total - embed
    assert weight_bytes_per_token(tied) == total - embed  # head reads the shared table
    assert torch.is_tensor(tied.lm_head.proj.weight)


def test_roofline_sets_each_plain_run_against_its_own_bandwidth_probe(tmp_path):
    """The probe drifts between runs: run 1 decodes at 80% of its probe, run 2 at 90% of a
    probe twice as fast; the median fraction and the spread come from the pairs, and the
    report prints both."""
    from types import SimpleNamespace

    from torch import nn

    from specmoe.bench.report import markdown
    from specmoe.bench.spec import roofline
    model = nn.Linear(1000, 1000, bias=False)  # 4 MB of fp32 weights per token
    engine = SimpleNamespace(target=SimpleNamespace(model=model))
    wb = weight_bytes_per_token(model)
    runs = [_run("humaneval", "none", 0, 0.0, 101, 100 / (0.8 * 1e9 / wb)),
            _run("gsm8k", "none", 0, 0.0, 101, 100 / (0.9 * 2e9 / wb)),
            _run("gsm8k", "draft", 2, 0.0, 101, 1.0)]
    runs[0]["read_bandwidth"], runs[1]["read_bandwidth"] = 1e9, 2e9
    rf = roofline(engine, runs)
    assert rf["fraction_of_roofline_range"] == pytest.approx([0.8, 0.9])
    assert rf["fraction_of_roofline"] == pytest.approx(0.85)
    assert rf["read_bandwidth_range_gb_s"] == pytest.approx([1.0, 2.0])
    results = {"config": {"target": "t", "draft": "d", "draft_quantization": "int4",
                          "dtype": "bfloat16", "max_tokens": 64, "num_prompts": 1},
               "total_seconds": 60.0, "rows": aggregate(runs), "runs": runs, "roofline": rf}
    assert "80-90% of the roofline, median 85%" in markdown(results)
    assert "before each plain run (1.0-2.0 GB/s" in markdown(results)  # one probe per run


def test_roofline_takes_the_higher_of_the_probes_around_a_run():
    """Memory sped up during run 0 (probe after it 2x the one before): the run is set
    against the faster probe, so its fraction halves rather than doubling."""
    from types import SimpleNamespace

    from torch import nn

    from specmoe.bench.report import markdown
    from specmoe.bench.spec import roofline, run_bandwidth
    model = nn.Linear(1000, 1000, bias=False)
    engine = SimpleNamespace(target=SimpleNamespace(model=model))
    wb = weight_bytes_per_token(model)
    runs = [_run("humaneval", "none", 0, 0.0, 101, 100 / (0.8 * 1e9 / wb)),
            _run("humaneval", "none", 0, 0.0, 101, 100 / (0.8 * 1e9 / wb))]
    runs[0]["read_bandwidth"], runs[0]["read_bandwidth_after"] = 1e9, 2e9
    runs[1]["read_bandwidth"], runs[1]["read_bandwidth_after"] = 1e9, 0.5e9
    assert [run_bandwidth(r) for r in runs] == [2e9, 1e9]
    rf = roofline(engine, runs)
    assert rf["fraction_of_roofline_range"] == pytest.approx([0.4, 0.8])
    assert rf["probes_per_run"] == 2
    results = {"config": {"target": "t", "draft": "d", "draft_quantization": "int4",
                          "dtype": "bfloat16", "max_tokens": 64, "num_prompts": 1},
               "total_seconds": 60.0, "rows": aggregate(runs), "runs": runs, "roofline": rf}
    assert "before and after each plain run (1.0-2.0 GB/s, the higher" in markdown(results)


def test_title_names_only_the_proposers_that_ran_and_bad_proposers_fail_first():
    from specmoe.bench.report import markdown
    from specmoe.bench.spec import SpecBenchConfig, run_spec_bench
    runs = [_run("humaneval", "none", 0, 0.0, 65, 8.0), _run("humaneval", "draft", 2, 0.0, 65, 4.0)]
    runs[0]["read_bandwidth"] = 1e9
    results = {"config": {"target": "t", "draft": "d", "draft_quantization": "int4",
                          "dtype": "bfloat16", "max_tokens": 64, "num_prompts": 1,
                          "proposers": ["draft"]},
               "total_seconds": 60.0, "rows": aggregate(runs), "runs": runs,
               "roofline": {"read_bandwidth_gb_s": 25.0, "weight_bytes_per_token": 2.5e9,
                            "roofline_tokens_per_s": 10.0, "plain_decode_tokens_per_s": 8.5,
                            "fraction_of_roofline": 0.85}}
    title = markdown(results).splitlines()[0]
    assert title == "# Speculative decoding: t with draft d (int4)"
    results["int4_batch_invariant"] = True  # SPECMOE_INT4_BATCH_INVARIANT=1 during the run
    assert "batch-invariant" not in markdown(results)  # the int4 model was the draft only
    results["config"]["quantization"] = "int4"
    assert "(activations bfloat16, int4 batch-invariant mode)" in markdown(results)
    with pytest.raises(ValueError, match="invalid proposers=\\['foo'\\]"):
        run_spec_bench(SpecBenchConfig(proposers=["foo"]))  # before any model loads
