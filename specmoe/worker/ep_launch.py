"""Starting, joining and stopping the ranks of an expert-parallel group
(`worker.expert_parallel` runs them).

One machine: `launch_workers` starts ranks 1..N-1 with `torch.multiprocessing` (spawn) and
rank 0 joins from the calling process, gloo on CPU, NCCL on CUDA. Across machines, torchrun
starts the ranks (`--nnodes`, `MASTER_ADDR`, `MASTER_PORT`), every rank runs the same
command and ranks > 0 serve as workers (`join_torchrun_group`). Every rank gets the same
`ExpertParallelConfig` (size, dispatch, placement, timeout) and loads only its experts under
it. A rank that dies or hangs makes rank 0's next collective fail within the config's
`timeout_s` (the process group's timeout) instead of hanging.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket

import torch
import torch.distributed as dist

from specmoe.config import ExpertParallelConfig
from specmoe.worker.expert_parallel import (ExpertParallelRunner, keep_rank_experts,
                                            shard_experts, worker_loop)
from specmoe.worker.model_runner import ModelRunner


def _backend(device) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_group(rank: int, world_size: int, port: int, device: str, timeout_s: float
               ) -> None:
    """Join the default group on 127.0.0.1:`port` (gloo on CPU, NCCL on CUDA)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(_backend(device), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def worker_main(rank: int, port: int, model_config, ep: ExpertParallelConfig,
                threads: int) -> None:
    """Entry of ranks > 0 spawned by `launch_workers`."""
    torch.set_num_threads(threads)
    init_group(rank, ep.size, port, model_config.device or "cpu", ep.timeout_s)
    serve_as_worker(model_config, ep)


def serve_as_worker(model_config, ep: ExpertParallelConfig) -> int:
    """A rank > 0 in the group: load the target with this rank's experts only (under `ep`'s
    placement), mirror rank 0's forwards until it stops, leave the group; returns the
    forwards run."""
    from specmoe.loader.model_loader import load_model
    try:
        hook = functools.partial(keep_rank_experts, ep=ep)
        runner = ModelRunner(load_model(model_config, on_weights=hook))
        shard_experts(runner, ep)
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


def join_torchrun_group(model_config, ep: ExpertParallelConfig) -> list[RemoteRank]:
    """Join the group torchrun set up (`env://`: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). Rank 0 returns the other ranks; a rank > 0 serves as a worker
    (`serve_as_worker`) and then exits the process (SystemExit), so the same command line
    runs on every rank.

    Raises:
        ValueError: torchrun's WORLD_SIZE differs from `ep.size`.
    """
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != ep.size:
        raise ValueError(f"expert_parallel_size={ep.size} but torchrun started {world} "
                         "processes (--nnodes x --nproc-per-node)")
    device = str(model_config.device or "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(_backend(device),
                            timeout=datetime.timedelta(seconds=ep.timeout_s))
    if rank > 0:
        serve_as_worker(model_config, ep)
        raise SystemExit(0)
    return [RemoteRank(r) for r in range(1, world)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(model_config, ep: ExpertParallelConfig, threads: int = 1):
    """Start ranks 1..ep.size-1 on this machine and join as rank 0; returns the worker
    processes (rank 0 then loads its own copy and wraps it in `ExpertParallelRunner`)."""
    import torch.multiprocessing as mp
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, port, model_config, ep, threads),
                         daemon=True) for r in range(1, ep.size)]
    for p in procs:
        p.start()
    init_group(0, ep.size, port, model_config.device or "cpu", ep.timeout_s)
    return procs


def abort(workers: list, wait_s: float) -> None:
    """Wait for worker processes to end (each within `wait_s`, else killed) and leave the
    group: after a stop (wait the group's timeout), or when they cannot be served (rank 0
    failed to load, a collective failed: wait 0, a hung rank would never end)."""
    for p in workers:
        p.join(timeout=wait_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    if dist.is_initialized():
        dist.destroy_process_group()


def start_group(model_config, ep: ExpertParallelConfig) -> list:
    """The other ranks of an `ep.size` group, this process joining as rank 0: under torchrun
    the ranks it started (a rank > 0 serves inside this call and exits), else worker
    processes started here. torch runs one intra-op thread per rank."""
    torch.set_num_threads(1)
    if launched_by_torchrun():
        return join_torchrun_group(model_config, ep)
    return launch_workers(model_config, ep)


def load_rank_zero(model_config, ep: ExpertParallelConfig, workers: list):
    """Rank 0's (loaded model, `ExpertParallelRunner`): only its experts under `ep`'s
    placement, in `ep`'s dispatch; the workers are stopped if loading fails."""
    from specmoe.loader.model_loader import load_model
    try:
        loaded = load_model(model_config, on_weights=functools.partial(keep_rank_experts,
                                                                        ep=ep))
        runner = ModelRunner(loaded)
        emap = shard_experts(runner, ep)
    except Exception:
        abort(workers, ep.timeout_s)
        raise
    return loaded, ExpertParallelRunner(runner, emap, ep.dispatch,
                                        heartbeat_s=ep.timeout_s / 4)
