"""The engine over 2 processes with the experts sharded (`LLM(expert_parallel_size=2)`):
rank 0 schedules and broadcasts every forward, the worker mirrors it; greedy output, plain
and with draft speculation, equals one process's; each rank holds only its experts; the
communication is counted (engine, bench, /metrics); the all_to_all dispatch with an
interleaved placement file gives the same tokens, every rank (spawned or started by
torchrun) holding the file's experts; a killed worker turns into an error on rank 0 within
the timeout, not a hang; shutdown stops the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specmoe import LLM, SamplingParams

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]


def test_two_processes_give_the_single_process_greedy_tokens():
    prompts = [[5, 17, 42, 99, 7, 23, 11], [3, 3, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    single = LLM("tiny-moe", dtype="float32")
    want = [o.token_ids for o in single.generate(prompts, params)]
    ep = LLM("tiny-moe", dtype="float32", expert_parallel_size=2)
    try:
        assert [o.token_ids for o in ep.generate(prompts, params)] == want
        spec = ep.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                    "num_speculative_tokens": 3})
        assert [o.token_ids for o in spec.generate(prompts, params)] == want
        workers = list(ep._workers)
        n = single.target.arch.moe.num_experts
        assert all(b.experts.num_experts == n // 2 for b in _blocks(ep))  # rank 0's half
        comm = ep.target.comm
        assert comm.num_forwards > 0 and comm.collective_calls > 0
        assert comm.collective_bytes > 0 and 0 < comm.share < 1
        _check_bench_and_metrics(ep)
    finally:
        ep.shutdown()
    assert all(not p.is_alive() and p.exitcode == 0 for p in workers)


def _blocks(llm):
    from specmoe.layers.moe.backends import moe_blocks
    return moe_blocks(llm.target.model)


def _check_bench_and_metrics(ep) -> None:
    """A bench run reports the communication and every (token, slot) pair's rank; the
    server's metrics export them."""
    from specmoe.bench.throughput_run import run_once
    from specmoe.entrypoints.openai.metrics import ServerMetrics
    metrics = ServerMetrics("m")
    assert metrics.attach_expert_parallel(ep.target)
    before = ep.target.comm.forward_seconds
    prompts = [{"token_ids": [5, 17, 42, 99]}, {"token_ids": [3, 3, 8]}]
    run = run_once(ep, prompts, concurrency=1, max_tokens=6, num_requests=2)  # 2 waves
    stats = run["expert_parallel"]
    arch = ep.target.arch
    tokens = run["engine_stats"]["num_scheduled_tokens"]
    assert sum(stats["rank_load"]) == tokens * arch.moe.top_k * len(_blocks(ep))
    assert 0 < stats["communication_share"] < 1 and stats["num_forwards"] == run[
        "engine_stats"]["num_steps"]
    assert all(type(b.stats).__name__ == "NullExpertStats" for b in _blocks(ep))
    metrics.expert_parallel.on_step({0: [3, 0, 1, 4] + [0] * (arch.moe.num_experts - 4)})
    text = metrics.render().decode()
    forward = ep.target.comm.forward_seconds - before
    assert f'specmoe:expert_parallel_forward_seconds_total{{model_name="m"}} {forward}' in text
    assert 'specmoe:expert_parallel_rank_load_total{model_name="m",rank="0"} 8.0' in text
    assert "specmoe:expert_parallel_communication_share" in text


def test_all_to_all_dispatch_with_an_interleaved_placement(tmp_path):
    """Greedy tokens, plain and with speculation, equal one process's; per forward each MoE
    layer issues 3 all_to_all and 1 all_gather, all counted."""
    prompts = [[5, 17, 42, 99, 7, 23, 11], [3, 3, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    single = LLM("tiny-moe", dtype="float32")
    want = [o.token_ids for o in single.generate(prompts, params)]
    placement = _interleaved(tmp_path, single.target.arch.moe.num_experts)
    ep = LLM("tiny-moe", dtype="float32", expert_parallel_size=2,
             expert_parallel_dispatch="all_to_all", expert_placement=str(placement))
    try:
        assert ep.config.expert_parallel.dispatch == ep.target.dispatch == "all_to_all"
        assert ep.target.expert_map.placement == tuple(json.loads(placement.read_text())[
            "placement"])
        before = ep.target.comm.copy()
        assert [o.token_ids for o in ep.generate(prompts, params)] == want
        step = ep.target.comm.since(before)
        assert step.collective_calls == 4 * len(_blocks(ep)) * step.num_forwards > 0
        spec = ep.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                    "num_speculative_tokens": 3})
        assert [o.token_ids for o in spec.generate(prompts, params)] == want
    finally:
        ep.shutdown()


def _interleaved(tmp_path: Path, num_experts: int) -> Path:
    """A placement file putting even experts on rank 0, odd on rank 1."""
    path = tmp_path / "interleaved.json"
    path.write_text(json.dumps({"placement": [e % 2 for e in range(num_experts)]}))
    return path


def test_a_killed_worker_is_an_error_on_rank_0_not_a_hang():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ep = LLM("tiny-moe", dtype="float32", expert_parallel_size=2)
    worker = ep._workers[0]
    try:
        ep.generate([[5, 17, 42]], params)
        worker.kill()
        worker.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            ep.generate([[5, 17, 42]], params)
        assert time.monotonic() - start < ep.config.expert_parallel.timeout_s + 10, info.value
    finally:
        ep.shutdown()


def test_idle_past_the_timeout_then_a_hung_worker_is_an_error_not_a_hang():
    """The workers wait for rank 0 inside a collective with the group's timeout: a server
    idle for longer must keep its workers (the heartbeat), and a worker that stops answering
    (SIGSTOP) must fail the next generate within the timeout, every later one at once, and
    shutdown must not wait for it."""
    import signal
    from specmoe.layers.moe.expert_parallel import RankFailure
    timeout = 6.0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ep = LLM("tiny-moe", dtype="float32", expert_parallel_size=2,
             expert_parallel_timeout_s=timeout)
    worker = ep._workers[0]
    try:
        want = ep.generate([[5, 17, 42]], params)[0].token_ids
        time.sleep(timeout + 3)
        assert ep.generate([[5, 17, 42]], params)[0].token_ids == want
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="timeout"):
            ep.generate([[5, 17, 42]], params)
        assert time.monotonic() - start < timeout + 5
        start = time.monotonic()
        with pytest.raises(RankFailure, match="failed earlier"):
            ep.generate([[1, 2]], params)
        assert time.monotonic() - start < 2
    finally:
        start = time.monotonic()
        ep.shutdown()
        assert time.monotonic() - start < 10
        assert not worker.is_alive()


def test_dense_models_bad_sizes_and_placements_are_refused(tmp_path):
    """Also a placement file for another expert count: known only once the model is read,
    so every rank refuses it at load and rank 0 stops the others."""
    import multiprocessing
    with pytest.raises(ValueError, match="expert_parallel_size=0"):
        LLM("tiny-moe", expert_parallel_size=0)
    with pytest.raises(ValueError, match="needs a MoE model"):
        LLM("tiny-moe-draft", dtype="float32", expert_parallel_size=2)
    with pytest.raises(ValueError, match="places 4 experts; the model has 32"):
        LLM("tiny-moe", dtype="float32", expert_parallel_size=2,
            expert_placement=str(_interleaved(tmp_path, 4)))
    assert not multiprocessing.active_children()


def test_torchrun_starts_the_ranks(tmp_path):
    """The same script on every rank under torchrun (the multi-machine launcher; here 2
    processes on one), in all_to_all dispatch with an interleaved placement file: rank 0
    gets the single-process tokens, holding half the experts, placed as the file says."""
    from specmoe.worker.ep_launch import free_port
    single = LLM("tiny-moe", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = single.generate([[5, 17, 42, 99, 7, 23, 11]], params)[0].token_ids
    script = Path(__file__).with_name("ep_torchrun_script.py")
    placement = _interleaved(tmp_path, single.target.arch.moe.num_experts)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
         "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "--local-ranks-filter", "0", str(script), "all_to_all", str(placement)],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == want
    assert got["experts"] == single.target.arch.moe.num_experts // 2
    assert got["placement"] == json.loads(placement.read_text())["placement"]
