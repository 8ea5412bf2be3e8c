"""Expert parallelism over 2 gloo processes on 127.0.0.1: both dispatch modes, and the
token-sliced all-to-all the engine uses, give the single-process MoE output (fp32) at T = 1,
5, 17, 80 tokens, under uneven routing, with a rank that receives no token, and with no token
at all on a rank; the bundled tiny-moe under EP=2 gives the single-process logits (prompts of
1, 5, 17, 80 tokens) in either engine dispatch, with contiguous and interleaved placements
and each rank holding only its experts, and, with speculation, the same greedy tokens;
expert maps."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specmoe.layers.moe.expert_parallel import (COLLECTIVES, ExpertMap, combine_all_to_all,
                                                combine_replicated, combine_token_sliced)
from specmoe.layers.moe.experts import RoutedExperts

N, H, I, K = 6, 16, 8, 2


def test_expert_maps():
    assert ExpertMap.contiguous(6, 2).placement == (0, 0, 0, 1, 1, 1)
    m = ExpertMap.balanced([10, 1, 1, 9, 1, 2], 2)
    assert sorted(m.rank_loads([10, 1, 1, 9, 1, 2])) == [12, 12]
    assert [len(m.local_experts(r)) for r in range(2)] == [3, 3]
    assert set(m.local_experts(0)).isdisjoint(m.local_experts(1))
    with pytest.raises(ValueError, match="hold no expert"):
        ExpertMap(2, (0, 0, 0))
    with pytest.raises(ValueError, match="invalid placement"):
        ExpertMap(2, (0, 2))


def test_a_subset_of_experts_computes_as_the_originals():
    experts = _experts()
    part = experts.subset([4, 1])
    assert part.num_experts == 2 and part.w13.shape[0] == part.w2.shape[0] == 2
    x = torch.randn(3, H)
    for i, e in enumerate([4, 1]):
        torch.testing.assert_close(part.expert_forward(i, x), experts.expert_forward(e, x))
    with pytest.raises(ValueError, match=r"cannot take experts \[6\]"):
        experts.subset([6])


def _experts() -> RoutedExperts:
    torch.manual_seed(0)
    e = RoutedExperts(N, H, I)
    with torch.no_grad():
        e.w13.normal_(0, 0.3)
        e.w2.normal_(0, 0.3)
    return e


def _routing(t: int, uneven: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    pool = torch.tensor([0, 1, 2]) if uneven else torch.arange(N)   # uneven: rank 0 only
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(t)])
    w = torch.softmax(torch.randn(t, K, generator=g), -1)
    return x, ids, w


def _worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        experts = _experts()
        for emap in (ExpertMap.contiguous(N, 2), ExpertMap.balanced([5, 1, 1, 4, 2, 3], 2)):
            mine = set(emap.local_experts(rank))

            def run_local(rows, ids, mine=mine):   # only this rank's experts may be asked
                assert set(ids.tolist()) <= mine
                return torch.cat([experts.expert_forward(int(e), rows[i:i + 1])
                                  for i, e in enumerate(ids)])
            for t in (1, 5, 17, 80):
                for uneven in (False, True):
                    x, ids, w = _routing(t, uneven, seed=t)
                    ref = experts.forward_reference(x, ids, w)
                    got = combine_replicated(x, ids, w, run_local, emap)
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
                    own = torch.arange(rank, t, 2)     # rank 1 has no token at T = 1
                    got = combine_all_to_all(x[own], ids[own], w[own], run_local, emap)
                    torch.testing.assert_close(got, ref[own], rtol=1e-5, atol=1e-5)
                    calls = COLLECTIVES.calls  # 3 all_to_all_single, then the all_gather
                    got = combine_token_sliced(x, ids, w, run_local, emap)
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
                    assert COLLECTIVES.calls - calls == 4
        _tiny_moe_under_ep(rank)
        results.put((rank, "ok"))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def _tiny_moe_under_ep(rank: int) -> None:
    from specmoe import LLM, SamplingParams
    from specmoe.layers.moe.backends import moe_blocks
    from specmoe.layers.moe.expert_parallel import set_expert_parallel
    plain = LLM("tiny-moe", dtype="float32")
    spec = plain.with_speculative({"method": "draft", "draft_model": "tiny-moe-draft",
                                   "num_speculative_tokens": 3})
    prompt = [5, 17, 42, 99, 7, 23, 11]
    runner = plain.target
    want_logits = {t: runner.forward(runner.new_cache(96), _prompt(t)) for t in (1, 5, 17, 80)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = plain.generate([prompt], params)[0].token_ids
    n = runner.arch.moe.num_experts
    emap = ExpertMap.contiguous(n, 2)
    set_expert_parallel(runner.model, emap)
    calls = COLLECTIVES.calls
    got_logits = runner.forward(runner.new_cache(96), _prompt(5))
    torch.testing.assert_close(got_logits, want_logits[5], rtol=1e-5, atol=1e-5)
    assert COLLECTIVES.calls - calls == len(moe_blocks(runner.model))  # one per MoE layer
    assert spec.generate([prompt], params)[0].token_ids == want
    _sharded_logits(rank, plain.config.model, n, want_logits)


def _prompt(t: int) -> list[int]:
    return [(5 + 37 * i) % 4000 + 1 for i in range(t)]


def _sharded_logits(rank: int, cfg, n: int, want: dict) -> None:
    """Each rank holding only its experts (dropped at load, before packing), in both engine
    dispatch modes, with contiguous and interleaved (a non-contiguous map) placements: the
    logits of prompts of T = 1, 5, 17, 80 tokens are one process's (T = 1: under
    all_to_all, rank 0's token slice is empty)."""
    from specmoe.layers.moe.backends import moe_blocks
    from specmoe.layers.moe.expert_parallel import keep_local_experts, set_expert_parallel
    from specmoe.loader.model_loader import load_model
    from specmoe.worker.model_runner import ModelRunner
    interleaved = ExpertMap(2, tuple(e % 2 for e in range(n)))
    for emap in (ExpertMap.contiguous(n, 2), interleaved):
        local = ModelRunner(load_model(
            cfg, on_weights=lambda m, emap=emap: keep_local_experts(m, emap, rank)))
        blocks = moe_blocks(local.model)
        assert all(b.experts.num_experts == n // 2 for b in blocks)
        backends = [b.run_experts for b in blocks]
        for dispatch, per_layer in (("replicated", 1), ("all_to_all", 4)):
            for b, backend in zip(blocks, backends):
                b.run_experts = backend
            set_expert_parallel(local.model, emap, dispatch=dispatch)
            for t, logits in want.items():
                calls = COLLECTIVES.calls
                got = local.forward(local.new_cache(96), _prompt(t))
                torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{dispatch} {emap} T={t}: {m}")
                assert COLLECTIVES.calls - calls == per_layer * len(blocks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_both_dispatch_modes_give_the_single_process_output():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    got = dict(results.get(timeout=5) for _ in procs)
    assert got == {0: "ok", 1: "ok"}
