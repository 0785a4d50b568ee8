"""A pool of local CPU ranks, started once and reused: run a function on every rank, get results.

Starting a process and importing torch + deepspeed costs seconds on a small machine, so tests and
benchmarks keep one world alive and send it work, and the ranks are forked from a server process that
imported those modules once (multiprocessing's forkserver), so a world of P ranks pays the imports once,
not P times. A function that raises on any rank makes
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


# what the fork server imports before it forks any rank: the imports every rank makes (torch, DeepSpeed for
# its comm backend), and what preload() adds
_preload = ["torch", "deepspeed", "ds_seqpar.comm", "ds_seqpar.deepspeed_shm"]


# environment variables the C runtime reads when a process starts, which a forked rank cannot take up
_READ_AT_EXEC = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD")


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (a test session adds transformers' model code). The server
    is one per parent process and reads the list once, when the first pool starts: call this before that;
    after, a module not preloaded is imported by each rank as it needs it, as without a fork server."""
    _preload.extend(m for m in modules if m not in _preload)


def _worker(rank: int, world: int, port: int, timeout_s: float, threads: int, tasks, results,
            environ: dict) -> None:
    # a forked rank inherits the fork server's environment (as of the first pool's start); a rank must see
    # the parent's environment of now, as a spawned one would
    os.environ.clear()
    os.environ.update(environ)
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
                 grace_s: float = 10.0, start_method: Optional[str] = None):
        """``start_method``: "forkserver" (the default), or "spawn": each rank a fresh interpreter that imports
        everything itself, for ranks whose environment must act at process start. A forked rank sees the
        parent's os.environ, but its allocator is the fork server's: so the default is spawn while the
        environment holds a setting the C runtime reads only when a process starts (glibc's MALLOC_* and
        GLIBC_TUNABLES, LD_PRELOAD; the memory benches set MALLOC_MMAP_THRESHOLD_)."""
        if start_method not in (None, "forkserver", "spawn"):
            raise ValueError(f"RankPool start_method={start_method!r}: choose 'forkserver' or 'spawn'")
        self.world_size, self.timeout_s, self.threads, self.grace_s = world_size, timeout_s, threads_per_rank, grace_s
        self.start_method = start_method
        self.method: Optional[str] = None          # how start() started the ranks: "forkserver" or "spawn"
        self._procs: List[mp.Process] = []

    def start(self) -> "RankPool":
        # forkserver, not fork: the parent may hold threads (a test runner's, a dataloader's) that a fork would
        # copy mid-lock; the server is a fresh single-threaded process. Importing torch starts no thread
        # pool (OpenMP's starts at the first parallel op, in each rank), so forking after it is safe.
        self.method = self.start_method or ("spawn" if any(k.startswith(_READ_AT_EXEC) for k in os.environ)
                                            else "forkserver")
        ctx = mp.get_context(self.method)
        if self.method == "forkserver":
            ctx.set_forkserver_preload(list(_preload))
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, port, self.timeout_s, self.threads,
                                         self._tasks[r], self._results, dict(os.environ)))
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
