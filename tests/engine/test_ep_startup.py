"""Expert-parallel start-up as real processes see it: sizes the model's config rules out
are refused before any worker starts, and workers die with their parent at any phase
(SIGTERM during loading, SIGKILL once serving) instead of living on under PID 1."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specmoe import LLM
from specmoe.utils import memory
from specmoe.worker import ep_launch

pytestmark = [pytest.mark.distributed]


def _children(pid: int) -> set[int]:
    """PIDs whose parent is `pid` (from /proc; psutil is not a dependency)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _serve(size: int, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specmoe.entrypoints.cli", "serve", "--model", "tiny-moe",
         "--dtype", "float32", "--expert-parallel-size", str(size), "--threads", "1",
         "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size,match", [
    (33, "expert_parallel_size=33 exceeds the 32 routed experts of tiny-moe"),
    (1000, "expert_parallel_size=1000 exceeds the 32 routed experts"),
])
def test_more_ranks_than_experts_refused_before_any_process(size, match):
    t0 = time.monotonic()
    proc = _serve(size, _free_port())
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert match in err and "Traceback" not in err
    assert time.monotonic() - t0 < 60  # it read a config; 32 workers took 65 s to fail


def test_ranks_beyond_cores_or_memory_refused_before_any_process(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    size = ep_launch.RANKS_PER_CORE * cores + 1
    if size <= 32:  # tiny-moe's experts bound it first on a machine with more cores
        with pytest.raises(ValueError, match=f"would start {size} processes on {cores} cores"):
            LLM("tiny-moe", dtype="float32", expert_parallel_size=size)
    monkeypatch.setattr(memory, "available_bytes", lambda: 100 << 20)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 ranks, each loading "
                       r"tiny-moe .*: 0\.\d GiB needed, 0\.1 GiB available on this machine"):
        LLM("tiny-moe", dtype="float32", expert_parallel_size=2)
    assert not multiprocessing.active_children()


def _wait_for_workers(server: subprocess.Popen, n: int, timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = _alive(_children(server.pid))
        if len(kids) >= n:
            return kids
        assert server.poll() is None, server.stderr.read()
        time.sleep(0.1)
    raise AssertionError(f"the server did not start {n} processes in {timeout_s} s")


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_die_with_a_server_killed_during_start_up(sig):
    """The issue's reproduction: the server is signalled while its workers load; the
    workers (and the resource tracker) are counted after the server is gone."""
    server = _serve(3, _free_port())
    try:
        kids = _wait_for_workers(server, 2, timeout_s=60)
        os.kill(server.pid, sig)
        server.wait(timeout=30)
        assert _wait_gone(kids, timeout_s=10) == set()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
