"""Start N local ranks of a module when no launcher did (``python -m ds_seqpar.train`` alone).

A launcher (deepspeed, torchrun, mpirun, srun) leaves its mark in the environment (env.py reads
it); without one, the command re-runs itself as N child processes with the env:// variables
torch.distributed reads. If a rank fails, its peers may be blocked in a collective with it: they
are terminated at once and the exit code is the failing rank's, so nothing is left hanging. Exit
code 2 is the exception: a configuration error that every rank finds by itself before any
communication, so the others get a grace period to say it too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import List, Sequence

from . import env as launch_env

CONFIG_ERROR = 2


def under_launcher() -> bool:
    return launch_env.under_launcher(os.environ)


def spawn_local(module: str, argv: Sequence[str], nprocs: int, grace_s: float = 15.0) -> int:
    """Run ``python -m module argv`` as ranks 0..nprocs-1 on this machine; return an exit code."""
    return spawn_command([sys.executable, "-u", "-m", module, *argv], nprocs, grace_s)


def spawn_command(command: Sequence[str], nprocs: int, grace_s: float = 15.0) -> int:
    """Run ``command`` (a script of one's own: the examples) as ranks 0..nprocs-1; return an exit code."""
    port = launch_env.free_port()
    procs: List[subprocess.Popen] = []
    for rank in range(nprocs):
        env = dict(os.environ, **launch_env.rank_env(rank, nprocs, port))
        procs.append(subprocess.Popen(list(command), env=env))
    failed_at, code = None, 0
    try:
        # poll every rank each time (any() would stop at the first live one and miss a failure)
        while [p.poll() for p in procs].count(None):
            bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if bad and failed_at is None:
                (rank, code), failed_at = bad[0], time.monotonic()
                if code != CONFIG_ERROR:     # a killed rank cannot say it itself
                    _say_exit(rank, code)
            if failed_at is not None and (code != CONFIG_ERROR or time.monotonic() - failed_at > grace_s):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    code = code or next((p.returncode for p in procs if p.returncode), 0)
    return 128 - code if code < 0 else code      # killed by signal N: the shell's 128 + N


def _say_exit(rank: int, code: int) -> None:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    sys.stderr.write(f"ds_seqpar.train: rank {rank} {how}; stopping the other ranks\n")
    sys.stderr.flush()


__all__ = ["under_launcher", "spawn_command", "spawn_local"]
