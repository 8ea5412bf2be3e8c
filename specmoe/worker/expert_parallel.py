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
import time
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist

from specmoe.layers.moe.backends import moe_blocks
from specmoe.layers.moe.expert_parallel import (COLLECTIVES, ExpertMap, keep_local_experts,
                                                set_expert_parallel)
from specmoe.worker.model_runner import ModelRunner

TIMEOUT_S = 60.0


@dataclass
class CommunicationStats:
    """Rank 0's forwards under expert parallelism since start: their wall seconds (the
    broadcast of the batch included), and of that the seconds, bytes sent and calls of the
    MoE combines' collectives; `share` is the communication share of forward time."""

    num_forwards: int = 0
    forward_seconds: float = 0.0
    broadcast_seconds: float = 0.0
    collective_seconds: float = 0.0
    collective_bytes: int = 0
    collective_calls: int = 0

    @property
    def communication_seconds(self) -> float:
        return self.broadcast_seconds + self.collective_seconds

    @property
    def share(self) -> float:
        return (self.communication_seconds / self.forward_seconds if self.forward_seconds
                else 0.0)

    def copy(self) -> "CommunicationStats":
        return replace(self)

    def since(self, earlier: "CommunicationStats") -> "CommunicationStats":
        """The forwards between `earlier` (a `copy` of these stats) and now."""
        return CommunicationStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                                     for f in fields(self)})

    def to_dict(self) -> dict:
        return {**asdict(self), "communication_share": self.share}


class ExpertParallelRunner:
    """Rank 0's target: a `ModelRunner` whose forwards are mirrored on the worker ranks.
    Other attributes are the wrapped runner's.

    Attributes:
        expert_map: the placement of the experts over the ranks.
        comm: `CommunicationStats` of the forwards run so far.
    """

    def __init__(self, runner: ModelRunner, expert_map: ExpertMap) -> None:
        self._runner = runner
        self._caches: dict[int, object] = {}
        self.expert_map = expert_map
        self.comm = CommunicationStats()

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
        seconds, calls, nbytes = COLLECTIVES.seconds, COLLECTIVES.calls, COLLECTIVES.bytes_sent
        start = time.perf_counter()
        _broadcast(("execute", cache_id, seqs))
        sent = time.perf_counter()
        try:
            return self._runner.execute(cache, seqs)
        finally:
            c = self.comm
            c.num_forwards += 1
            c.forward_seconds += time.perf_counter() - start
            c.broadcast_seconds += sent - start
            c.collective_seconds += COLLECTIVES.seconds - seconds
            c.collective_calls += COLLECTIVES.calls - calls
            c.collective_bytes += COLLECTIVES.bytes_sent - nbytes

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


def expert_map(model: torch.nn.Module) -> ExpertMap:
    """The placement of the model's experts over the default group (contiguous).

    Raises:
        ValueError: a dense model (nothing to shard), or fewer experts than ranks.
    """
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("expert parallelism needs a MoE model: this one has no MoE layer")
    return ExpertMap.contiguous(blocks[0].router.num_experts, dist.get_world_size())


def keep_rank_experts(model: torch.nn.Module) -> None:
    """`load_model`'s `on_weights` hook: keep only this rank's experts in memory."""
    keep_local_experts(model, expert_map(model), dist.get_rank())


def shard_experts(runner: ModelRunner) -> ExpertMap:
    """Put the loaded model's MoE blocks in expert-parallel mode over the default group
    (loaded whole, or with `keep_rank_experts`).

    Raises:
        ValueError: as `expert_map`.
    """
    emap = expert_map(runner.model)
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
    """Entry of ranks > 0 spawned by `launch_workers`."""
    torch.set_num_threads(threads)
    init_group(rank, world_size, port, model_config.device or "cpu")
    serve_as_worker(model_config)


def serve_as_worker(model_config) -> int:
    """A rank > 0 in the group: load the target with this rank's experts only, mirror rank
    0's forwards until it stops, leave the group; returns the forwards run."""
    from specmoe.loader.model_loader import load_model
    try:
        runner = ModelRunner(load_model(model_config, on_weights=keep_rank_experts))
        shard_experts(runner)
        return worker_loop(runner)
    finally:
        dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """Whether torchrun (torch.distributed.run) started this process (it sets these)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                         "TORCHELASTIC_RUN_ID"))


class RemoteRank:
    """A rank torchrun started (possibly on another machine): nothing to join or kill here;
    it leaves when rank 0 stops it or its collectives fail."""

    exitcode = 0

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def kill(self) -> None:
        pass


def join_torchrun_group(world_size: int, model_config) -> list[RemoteRank]:
    """Join the group torchrun set up (`env://`: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). Rank 0 returns the other ranks; a rank > 0 serves as a worker
    (`serve_as_worker`) and then exits the process (SystemExit), so the same command line
    runs on every rank.

    Raises:
        ValueError: torchrun's WORLD_SIZE differs from `world_size`.
    """
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != world_size:
        raise ValueError(f"expert_parallel_size={world_size} but torchrun started {world} "
                         "processes (--nnodes x --nproc-per-node)")
    device = str(model_config.device or "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if rank > 0:
        serve_as_worker(model_config)
        raise SystemExit(0)
    return [RemoteRank(r) for r in range(1, world)]


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
    """Wait for worker processes to end (each within TIMEOUT_S, else killed) and leave the
    group: after a stop, or when they cannot be served (rank 0 failed to load, a rank
    died)."""
    for p in workers:
        p.join(timeout=TIMEOUT_S)
        if p.is_alive():
            p.kill()
    if dist.is_initialized():
        dist.destroy_process_group()
