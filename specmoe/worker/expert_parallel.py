"""Running a MoE target over N processes with its experts sharded (expert parallelism).

Rank 0 runs the engine (scheduler, proposer, sampling, the API) as in one process; its target
is an `ExpertParallelRunner`, which, before every forward, broadcasts the batch (the
`SequenceInput`s and which KV cache they use) to the other ranks. Ranks 1..N-1 run
`worker_loop`: the same forward on the same batch, each MoE layer computing only its rank's
experts and summing over ranks (`layers.moe.expert_parallel.set_expert_parallel`). The draft
model and everything dense outside the MoE layers run on every rank alike; only rank 0's
logits are used.

One machine: `launch_workers` starts ranks 1..N-1 with `torch.multiprocessing` (spawn) and
rank 0 joins from the calling process, gloo on CPU, NCCL on CUDA. Across machines, torchrun
starts the ranks (`--nnodes`, `MASTER_ADDR`, `MASTER_PORT`) and ranks > 0 call
`worker_main`. A rank that dies makes rank 0's next collective fail within `timeout_s`
(gloo's timeout) instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from specmoe.layers.moe.backends import moe_blocks
from specmoe.layers.moe.expert_parallel import ExpertMap, set_expert_parallel
from specmoe.worker.model_runner import ModelRunner

TIMEOUT_S = 60.0


class ExpertParallelRunner:
    """Rank 0's target: a `ModelRunner` whose forwards are mirrored on the worker ranks.
    Other attributes are the wrapped runner's."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._caches: dict[int, object] = {}

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def new_paged_cache(self, num_blocks: int, block_size: int):
        cache = self._runner.new_paged_cache(num_blocks, block_size)
        cache_id = len(self._caches)
        self._caches[cache_id] = cache
        _broadcast(("cache", cache_id, num_blocks, block_size))
        return cache

    def execute(self, cache, seqs):
        cache_id = next(i for i, c in self._caches.items() if c is cache)
        _broadcast(("execute", cache_id, seqs))
        return self._runner.execute(cache, seqs)

    def shutdown(self) -> None:
        """Stop the worker ranks (their loops return)."""
        if dist.is_initialized():
            _broadcast(("stop",))


def _broadcast(message: tuple) -> tuple:
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker_loop(runner: ModelRunner) -> int:
    """Ranks > 0: mirror rank 0's forwards until it stops; returns the forwards run."""
    caches: dict[int, object] = {}
    forwards = 0
    while True:
        message = _broadcast((None,))
        if message[0] == "stop":
            return forwards
        if message[0] == "cache":
            _, cache_id, num_blocks, block_size = message
            caches[cache_id] = runner.new_paged_cache(num_blocks, block_size)
        elif message[0] == "execute":
            _, cache_id, seqs = message
            runner.execute(caches[cache_id], seqs)
            forwards += 1


def shard_experts(runner: ModelRunner) -> ExpertMap:
    """Put the loaded model's MoE blocks in expert-parallel mode over the default group
    (contiguous placement).

    Raises:
        ValueError: a dense model (nothing to shard), or fewer experts than ranks.
    """
    blocks = moe_blocks(runner.model)
    if not blocks:
        raise ValueError("expert parallelism needs a MoE model: this one has no MoE layer")
    emap = ExpertMap.contiguous(blocks[0].experts.num_experts, dist.get_world_size())
    set_expert_parallel(runner.model, emap)
    return emap


def init_group(rank: int, world_size: int, port: int, device: str = "cpu",
               timeout_s: float = TIMEOUT_S) -> None:
    """Join the default group on 127.0.0.1:`port` (gloo on CPU, NCCL on CUDA)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if str(device).startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def worker_main(rank: int, world_size: int, port: int, model_config, threads: int) -> None:
    """Entry of ranks > 0 (spawned by `launch_workers`): load the target, shard its experts,
    mirror rank 0's forwards."""
    from specmoe.loader.model_loader import load_model
    torch.set_num_threads(threads)
    init_group(rank, world_size, port, model_config.device or "cpu")
    try:
        runner = ModelRunner(load_model(model_config))
        shard_experts(runner)
        worker_loop(runner)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(world_size: int, model_config, threads: int = 1):
    """Start ranks 1..world_size-1 on this machine and join as rank 0; returns the worker
    processes (rank 0 then loads its own copy and wraps it in `ExpertParallelRunner`)."""
    import torch.multiprocessing as mp
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, world_size, port, model_config, threads),
                         daemon=True) for r in range(1, world_size)]
    for p in procs:
        p.start()
    init_group(0, world_size, port, model_config.device or "cpu")
    return procs


def abort(workers: list) -> None:
    """Stop worker processes that cannot be served (rank 0 failed before its first
    broadcast) and leave the group."""
    for p in workers:
        p.join(timeout=TIMEOUT_S)
        if p.is_alive():
            p.kill()
    dist.destroy_process_group()
