"""`specmoe expert-placement` and the expert-parallel options, in one process: the load
measured by running tiny-moe equals the load a /metrics scrape of the same requests holds,
both write a placement file the engine reads; /metrics shows the configured placement; bad
dispatch values and placement files fail before any process starts."""

from __future__ import annotations

import json
import multiprocessing
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specmoe import LLM, SamplingParams
from specmoe.analysis.expert_placement import (load_from_metrics, measure_expert_load,
                                               sum_over_layers)
from specmoe.engine.async_engine import EngineSnapshot
from specmoe.entrypoints.cli import build_parser, main
from specmoe.entrypoints.openai.metrics import ServerMetrics
from specmoe.layers.moe.placement import ExpertMap, read_placement
from specmoe.outputs import SpecDecodeStats

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8, 1, 60, 61]]


@pytest.fixture(scope="module")
def tiny_moe() -> LLM:
    return LLM("tiny-moe", dtype="float32")


def _scrape(llm: LLM) -> str:
    """/metrics text after serving PROMPTS with every step's expert load recorded."""
    metrics = ServerMetrics("m")
    assert metrics.attach_expert_load(llm.target.model, every=1)
    llm.reset_prefix_cache()
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    metrics.on_step(EngineSnapshot(
        num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=10,
        num_prefix_queries=0, num_prefix_hits=0, num_preemptions=0, spec=SpecDecodeStats(),
        num_step_failures=0))
    return metrics.render().decode()


def test_metrics_hold_the_load_a_run_measures(tiny_moe, tmp_path):
    n = tiny_moe.target.arch.moe.num_experts
    text = _scrape(tiny_moe)
    tiny_moe.reset_prefix_cache()
    measured = measure_expert_load(tiny_moe, PROMPTS, max_tokens=6)
    assert load_from_metrics(text, n) == measured
    assert len(measured) == len(tiny_moe.target.arch.moe.moe_layers)
    scrape = tmp_path / "metrics.txt"
    scrape.write_text(text)
    out = tmp_path / "placement.json"
    assert main(["expert-placement", "--metrics", str(scrape), "--num-experts", str(n),
                 "--ranks", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["load"] == sum_over_layers(measured)
    assert read_placement(out, 2, n) == ExpertMap.balanced(data["load"], 2)
    assert data["source"] == {"metrics": str(scrape), "num_layers": len(measured)}
    with pytest.raises(ValueError, match="expert_load_total"):
        load_from_metrics("# nothing here\n")
    with pytest.raises(ValueError, match="num_experts=2"):
        load_from_metrics(text, 2)


def test_the_command_measures_a_model_on_the_bundled_prompts(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["expert-placement", "--model", "tiny-moe", "--ranks", "4", "--out", str(out),
                 "--num-prompts", "2", "--max-tokens", "4", "--dtype", "float32"]) == 0
    data = json.loads(out.read_text())
    pred = data["predicted"]
    assert data["num_ranks"] == 4 and len(data["placement"]) == data["num_experts"] == 32
    assert pred["balanced"]["max_over_mean"] <= pred["contiguous"]["max_over_mean"]
    assert data["source"]["num_prompts"] == 2 and data["source"]["model"] == "tiny-moe"
    assert "max/mean" in capsys.readouterr().out
    assert main(["expert-placement", "--ranks", "2", "--out", str(out)]) == 2
    assert "one of --model" in capsys.readouterr().err


def test_the_dispatch_and_placement_options_reach_the_engine():
    for command in (["generate", "--prompt", "x"], ["serve"], ["bench", "throughput"]):
        args = build_parser().parse_args(command + ["--expert-parallel-dispatch", "all_to_all",
                                                    "--expert-placement", "p.json",
                                                    "--expert-parallel-timeout", "5"])
        assert (args.expert_parallel_dispatch, args.expert_placement) == ("all_to_all",
                                                                          "p.json")
        assert args.expert_parallel_timeout == 5.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--expert-parallel-dispatch", "ring"])


def test_bad_dispatch_and_placement_fail_before_any_process_starts(tmp_path):
    from specmoe.bench.throughput import ThroughputBenchConfig
    with pytest.raises(ValueError, match="expert_parallel_dispatch='ring'"):
        LLM("tiny-moe", expert_parallel_size=2, expert_parallel_dispatch="ring")
    with pytest.raises(ValueError, match="expert_parallel_dispatch='ring'"):
        ThroughputBenchConfig(expert_parallel_dispatch="ring")
    for timeout in (0, -1.0, float("nan"), "60", True):
        with pytest.raises(ValueError, match="expert_parallel_timeout_s="):
            LLM("tiny-moe", expert_parallel_size=2, expert_parallel_timeout_s=timeout)
    with pytest.raises(ValueError, match="expert_parallel_timeout_s=0"):
        ThroughputBenchConfig(expert_parallel_timeout_s=0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"placement": [0, 1, 3, 1]}))
    with pytest.raises(ValueError, match="expert 2 on rank 3"):
        LLM("tiny-moe", expert_parallel_size=2, expert_placement=str(bad))
    bad.write_text("[0, 1")
    with pytest.raises(ValueError, match="not JSON"):
        LLM("tiny-moe", expert_parallel_size=2, expert_placement=str(bad))
    with pytest.raises(FileNotFoundError, match="no such file"):
        LLM("tiny-moe", expert_parallel_size=2, expert_placement=str(tmp_path / "no.json"))
    assert not multiprocessing.active_children()


def test_metrics_show_the_configured_placement():
    """An expert-parallel target's /metrics: each expert's rank, and the per-rank load under
    its (interleaved) placement, not contiguous blocks."""
    from specmoe.worker.expert_parallel import CommunicationStats
    runner = SimpleNamespace(expert_map=ExpertMap(2, (0, 1, 0, 1)), comm=CommunicationStats())
    metrics = ServerMetrics("m")
    assert metrics.attach_expert_parallel(runner)
    metrics.expert_parallel.on_step({0: [3, 0, 1, 5], 1: [0, 0, 4, 0]})
    samples = [s for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples]
    load = {s.labels["rank"]: s.value for s in samples
            if s.name == "specmoe:expert_parallel_rank_load_total"}
    assert load == {"0": 8.0, "1": 5.0}     # contiguous blocks would be 3 and 10
    ranks = {s.labels["expert"]: s.value for s in samples
             if s.name == "specmoe:expert_parallel_expert_rank"}
    assert ranks == {"0": 0.0, "1": 1.0, "2": 0.0, "3": 1.0}
