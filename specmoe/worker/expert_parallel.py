"""Running a MoE target over N processes with its experts sharded (expert parallelism).

Rank 0 runs the engine (scheduler, proposer, sampling, the API) as in one process; its target
is an `ExpertParallelRunner`, which, before every forward, broadcasts the batch (the
`SequenceInput`s and which KV cache they use) to the other ranks. Ranks 1..N-1 run
`worker_loop`: the same forward on the same batch, each MoE layer computing only its rank's
experts and combining over ranks (`layers.moe.expert_parallel.set_expert_parallel`: an
all_reduce in "replicated" dispatch, the token-sliced all-to-all in "all_to_all"). Every rank
places the experts by the same `ExpertParallelConfig` (contiguous, or a placement file) and
keeps only its own in memory. The draft model and everything dense outside the MoE layers run
on every rank alike; only rank 0's logits are used.

Starting, joining and stopping the ranks (spawned on one machine, or by torchrun) is
`worker.ep_launch`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist

from specmoe.config import ExpertParallelConfig
from specmoe.layers.moe.backends import moe_blocks
from specmoe.layers.moe.expert_parallel import (COLLECTIVES, RankFailure, group_call,
                                                keep_local_experts, set_expert_parallel)
from specmoe.layers.moe.placement import CONTIGUOUS, ExpertMap, read_placement
from specmoe.worker.model_runner import ModelRunner


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

    The workers wait for rank 0's next message inside a collective, which fails after the
    group's timeout: while rank 0 is idle (a server between requests) a heartbeat thread
    sends a "ping" every `heartbeat_s`, so idle workers stay in the group, and a worker that
    died or hangs is found while idle too (`failure`). A lock keeps rank 0's messages and
    forwards in one order, the order every worker runs them in.

    Attributes:
        expert_map: the placement of the experts over the ranks (the configured one).
        dispatch: how the ranks exchange tokens ("replicated" or "all_to_all").
        comm: `CommunicationStats` of the forwards run so far.
        failure: the `RankFailure` that ended the group (None while it works); every later
            forward raises it again at once.
    """

    def __init__(self, runner: ModelRunner, expert_map: ExpertMap,
                 dispatch: str = "replicated", heartbeat_s: float | None = None) -> None:
        self._runner = runner
        self._caches: dict[int, object] = {}
        self.expert_map = expert_map
        self.dispatch = dispatch
        self.comm = CommunicationStats()
        self.failure: RankFailure | None = None
        self._lock = threading.Lock()
        self._last_message = time.monotonic()
        self._stopped = threading.Event()
        self._heartbeat = None
        if heartbeat_s is not None:
            self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,),
                                               name="specmoe-ep-heartbeat", daemon=True)
            self._heartbeat.start()

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def _send(self, message: tuple) -> None:
        """Broadcast `message` to the workers (hold `_lock`); a failure ends the group."""
        try:
            _broadcast(message)
        except RankFailure as e:
            self.failure = e
            raise
        self._last_message = time.monotonic()

    def _beat(self, interval: float) -> None:
        while not self._stopped.wait(interval / 4):
            with self._lock:
                if self._stopped.is_set() or self.failure is not None:
                    return
                if time.monotonic() - self._last_message >= interval:
                    try:
                        self._send(("ping",))
                    except RankFailure:
                        return

    def new_paged_cache(self, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto"):
        cache = self._runner.new_paged_cache(num_blocks, block_size, kv_cache_dtype)
        with self._lock:
            cache_id = len(self._caches)
            self._caches[cache_id] = cache
            self._send(("cache", cache_id, num_blocks, block_size, kv_cache_dtype))
        return cache

    def execute(self, cache, seqs):
        """The wrapped runner's forward, mirrored on the other ranks.

        Raises:
            RankFailure: a rank died or hangs (now, or earlier: then at once).
        """
        with self._lock:
            if self.failure is not None:
                raise RankFailure(f"the expert-parallel group failed earlier ({self.failure});"
                                  " shut this LLM down and start a new one")
            return self._execute(cache, seqs)

    def _execute(self, cache, seqs):
        cache_id = next(i for i, c in self._caches.items() if c is cache)
        seconds, calls, nbytes = COLLECTIVES.seconds, COLLECTIVES.calls, COLLECTIVES.bytes_sent
        start = sent = time.perf_counter()
        try:
            self._send(("execute", cache_id, seqs))
            sent = time.perf_counter()
            return self._runner.execute(cache, seqs)
        except RankFailure as e:
            self.failure = e
            raise
        finally:
            self._last_message = time.monotonic()
            c = self.comm
            c.num_forwards += 1
            c.forward_seconds += time.perf_counter() - start
            c.broadcast_seconds += sent - start
            c.collective_seconds += COLLECTIVES.seconds - seconds
            c.collective_calls += COLLECTIVES.calls - calls
            c.collective_bytes += COLLECTIVES.bytes_sent - nbytes

    def shutdown(self) -> None:
        """Stop the heartbeat and the worker ranks (their loops return).

        Raises:
            RankFailure: the stop could not be sent (a rank died or hangs).
        """
        self._stopped.set()
        with self._lock:
            if dist.is_initialized() and self.failure is None:
                self._send(("stop",))


def _broadcast(message: tuple) -> tuple:
    box = [message]
    group_call(dist.broadcast_object_list, box, src=0)
    return box[0]


def worker_loop(runner: ModelRunner) -> int:
    """Ranks > 0: mirror rank 0's forwards until it stops; returns the forwards run."""
    caches: dict[int, object] = {}
    forwards = 0
    while True:
        message = _broadcast((None,))
        if message[0] == "stop":
            return forwards
        if message[0] == "ping":  # rank 0 is idle
            continue
        if message[0] == "cache":
            _, cache_id, num_blocks, block_size, kv_cache_dtype = message
            caches[cache_id] = runner.new_paged_cache(num_blocks, block_size, kv_cache_dtype)
        elif message[0] == "execute":
            _, cache_id, seqs = message
            runner.execute(caches[cache_id], seqs)
            forwards += 1


def expert_map(model: torch.nn.Module, ep: ExpertParallelConfig) -> ExpertMap:
    """The placement of the model's experts over the default group: contiguous, or read
    from `ep.placement` (a placement file, checked against the group and the model).

    Raises:
        ValueError: a dense model (nothing to shard), fewer experts than ranks, or a bad
            placement file (`layers.moe.placement.read_placement`).
        FileNotFoundError: no such placement file.
    """
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("expert parallelism needs a MoE model: this one has no MoE layer")
    n, world = blocks[0].router.num_experts, dist.get_world_size()
    if ep.placement == CONTIGUOUS:
        return ExpertMap.contiguous(n, world)
    return read_placement(ep.placement, world, n)


def keep_rank_experts(model: torch.nn.Module, ep: ExpertParallelConfig) -> None:
    """`load_model`'s `on_weights` hook (bind `ep` with functools.partial): keep only this
    rank's experts under `ep`'s placement in memory."""
    keep_local_experts(model, expert_map(model, ep), dist.get_rank())


def shard_experts(runner: ModelRunner, ep: ExpertParallelConfig) -> ExpertMap:
    """Put the loaded model's MoE blocks in expert-parallel mode over the default group, with
    `ep`'s placement and dispatch (loaded whole, or with `keep_rank_experts`).

    Raises:
        ValueError, FileNotFoundError: as `expert_map`.
    """
    emap = expert_map(runner.model, ep)
    set_expert_parallel(runner.model, emap, dispatch=ep.dispatch)
    return emap
