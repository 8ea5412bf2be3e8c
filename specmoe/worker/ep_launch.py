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
import sys
import threading
import time

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
                threads: int, parent_pid: int) -> None:
    """Entry of ranks > 0 spawned by `launch_workers`: ends with its parent
    (`exit_with_parent`), and reports a failure in one line on stderr, not a traceback
    (rank 0 reports the group's failure to the user)."""
    exit_with_parent(parent_pid)
    try:
        torch.set_num_threads(threads)
        init_group(rank, ep.size, port, model_config.device or "cpu", ep.timeout_s)
        serve_as_worker(model_config, ep)
    except Exception as exc:  # noqa: BLE001 - one line per failed rank, then exit 1
        print(f"specmoe: expert-parallel rank {rank} stopped: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def exit_with_parent(parent_pid: int, interval_s: float = 0.2) -> threading.Thread:
    """Start a daemon thread that ends this process (`os._exit(1)`, no clean-up: the
    parent that would be told is gone) once its parent `parent_pid` is no longer its
    parent, whatever phase the process is in (loading, joining the group, serving); a
    SIGKILLed or SIGTERMed server so leaves no worker behind. Polls `os.getppid()` every
    `interval_s` seconds (portable, and unlike PR_SET_PDEATHSIG not tied to the parent
    thread that started the process)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)
    thread = threading.Thread(target=watch, name="specmoe-parent-watch", daemon=True)
    thread.start()
    return thread


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
    procs = [ctx.Process(target=worker_main,
                         args=(r, port, model_config, ep, threads, os.getpid()),
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


# Resident memory of a rank beyond its model: the interpreter, torch and the gloo group
# (232-240 MiB a worker measured on tiny-moe with 4 and 32 ranks).
RANK_BASE_BYTES = 256 << 20
# Ranks this machine may run per core (each runs one torch thread; more only time-share).
RANKS_PER_CORE = 4


def check_group(model_config, ep: ExpertParallelConfig, local: bool = True) -> None:
    """Refuse, before any process starts, a group the model's config alone shows cannot
    run: a dense model, more ranks than routed experts (or a placement file that does not
    fit), and for ranks started on this machine (`local`) more than `RANKS_PER_CORE` per
    core or more memory than is available (each rank loads the model before dropping the
    experts it does not hold, plus `RANK_BASE_BYTES`).

    Raises:
        ValueError: naming the size and the bound it exceeds.
        FileNotFoundError: no such placement file, or model.
    """
    from specmoe.layers.moe.placement import CONTIGUOUS, read_placement
    from specmoe.loader.model_loader import DTYPES, read_arch
    from specmoe.utils.memory import check_fits
    arch = read_arch(model_config)
    if arch.moe is None or not arch.moe.moe_layers:
        raise ValueError(f"expert parallelism needs a MoE model: {model_config.model} has no "
                         "MoE layer")
    n = arch.moe.num_experts
    if ep.placement != CONTIGUOUS:
        read_placement(ep.placement, ep.size, n)
    elif ep.size > n:
        raise ValueError(f"expert_parallel_size={ep.size} exceeds the {n} routed experts of "
                         f"{model_config.model}: every rank must hold at least one")
    if not local:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if ep.size > RANKS_PER_CORE * (cores or 1):
        raise ValueError(f"expert_parallel_size={ep.size} would start {ep.size} processes on "
                         f"{cores} cores (at most {RANKS_PER_CORE} per core here); spread "
                         "the ranks over machines with torchrun")
    per_rank = arch.num_params * DTYPES[model_config.dtype].itemsize  # at full precision
    check_fits(ep.size * per_rank + (ep.size - 1) * RANK_BASE_BYTES,
               f"expert_parallel_size={ep.size} ranks, each loading {model_config.model} "
               f"({per_rank / (1 << 30):.2f} GiB) before dropping the experts it does not hold")


def start_group(model_config, ep: ExpertParallelConfig) -> list:
    """The other ranks of an `ep.size` group, this process joining as rank 0: under torchrun
    the ranks it started (a rank > 0 serves inside this call and exits), else worker
    processes started here, once `check_group` has passed. torch runs one intra-op thread
    per rank.

    Raises:
        ValueError, FileNotFoundError: as `check_group`.
    """
    torchrun = launched_by_torchrun()
    check_group(model_config, ep, local=not torchrun)
    torch.set_num_threads(1)
    if torchrun:
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
