"""Start N local ranks of a module when no launcher did (``python -m ds_seqpar.train`` alone).

A launcher (deepspeed, torchrun, mpirun, srun) leaves its mark in the environment; without one,
the command re-runs itself as N child processes with the env:// variables torch.distributed
reads. If a rank fails, its peers may be blocked in a collective: they get a grace period, then
are terminated, and the exit code is the failing rank's, so nothing is left hanging.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List, Sequence

from .env import free_port, rank_env

LAUNCHER_VARS = ("RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def under_launcher() -> bool:
    return any(v in os.environ for v in LAUNCHER_VARS)


def spawn_local(module: str, argv: Sequence[str], nprocs: int, grace_s: float = 15.0) -> int:
    """Run ``python -m module argv`` as ranks 0..nprocs-1 on this machine; return an exit code."""
    port = free_port()
    procs: List[subprocess.Popen] = []
    for rank in range(nprocs):
        env = dict(os.environ, **rank_env(rank, nprocs, port))
        procs.append(subprocess.Popen([sys.executable, "-u", "-m", module, *argv], env=env))
    failed_at, code = None, 0
    try:
        while any(p.poll() is None for p in procs):
            bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if bad and failed_at is None:
                failed_at, code = time.monotonic(), bad[0]
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return code or next((p.returncode for p in procs if p.returncode), 0)


__all__ = ["under_launcher", "spawn_local"]
