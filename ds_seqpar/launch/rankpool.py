"""A pool of local CPU ranks, started once and reused: run a function on every rank, get results.

Starting a process and importing torch + deepspeed costs seconds on a small machine, so tests and
benchmarks keep one world alive and send it work. A function that raises on any rank makes
``run`` raise with that rank's traceback; ranks stuck in a collective with a failed peer are
killed after a grace period and the pool restarts on its next use, so nothing hangs.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, List, Optional

from .env import free_port, rank_env


class RankFailure(AssertionError):
    """One or more ranks raised (or hung); the message holds each failing rank's traceback."""


def _worker(rank: int, world: int, port: int, timeout_s: float, threads: int, tasks, results) -> None:
    os.environ.update(rank_env(rank, world, port))
    import torch
    torch.set_num_threads(threads)
    from ds_seqpar import comm
    from ds_seqpar.deepspeed_shm import skip_deepspeed_shm_op
    comm.init_local(rank, world, port, timeout_s)
    skip_deepspeed_shm_op()         # before any task starts DeepSpeed's comm backend
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - any failure must reach the parent with its traceback
            results.put((rank, "error", traceback.format_exc()))
        _settle_heap()
    comm.destroy()
    # multiprocessing flushes the queues and runs its own exit work when this returns; the exit
    # handler registered last runs first and ends the process there, without the interpreter's
    # teardown of a long-lived heap (seconds after a test session's many models, more than close()
    # waits)
    atexit.register(os._exit, 0)


def _settle_heap() -> None:
    """Between tasks: collect the task's garbage, then freeze what survives (imports, caches, kept models) out
    of the cyclic collector's view. A long-lived rank's heap only grows, and every full collection walks all of
    it: DeepSpeed's ZeRO-3 engine calls gc.collect() while it builds, so each engine paid for every object the
    earlier tasks left (half a second per rank late in a test session). Frozen objects are still freed when
    their last reference goes; only a cycle that dies after being frozen stays, and a pool's survivors are
    caches and kept models that live as long as the pool."""
    import gc
    gc.collect()
    gc.freeze()


class RankPool:
    def __init__(self, world_size: int, timeout_s: float = 120.0, threads_per_rank: int = 1,
                 grace_s: float = 10.0):
        self.world_size, self.timeout_s, self.threads, self.grace_s = world_size, timeout_s, threads_per_rank, grace_s
        self._procs: List[mp.Process] = []

    def start(self) -> "RankPool":
        ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, port, self.timeout_s, self.threads,
                                         self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect("ready", deadline=time.monotonic() + 300)
        return self

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout: Optional[float] = None, **kwargs) -> List[Any]:
        """Call fn(*args, **kwargs) on every rank; return the per-rank results in rank order."""
        if not self.alive:
            self.shutdown()
            self.start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect("ok", deadline=time.monotonic() + (timeout or self.timeout_s))

    def _collect(self, expected: str, deadline: float) -> List[Any]:
        out, errors = {}, {}
        self._first_error_at = 0.0
        while len(out) + len(errors) < self.world_size:
            # once a rank failed, its peers may be blocked in a collective: wait briefly, not forever
            limit = min(deadline, self._first_error_at + self.grace_s) if errors else deadline
            try:
                rank, status, payload = self._results.get(timeout=max(0.1, limit - time.monotonic()))
            except queue.Empty:
                if time.monotonic() >= limit:
                    break
                continue
            if status == "error":
                if not errors:
                    self._first_error_at = time.monotonic()
                errors[rank] = payload
            else:
                out[rank] = payload
        if errors or len(out) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in out and r not in errors]
            self.shutdown()   # a world with a failed or stuck rank cannot be trusted again
            parts = [f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(f"--- ranks {missing} did not finish (hung or died); pool restarted ---")
            raise RankFailure("\n".join(parts))
        return [out[r] for r in range(self.world_size)]

    def shutdown(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []

    def close(self) -> None:
        """Polite stop: let every rank leave the process group."""
        if self.alive:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        self.shutdown()
