"""Fault injection for the reliability tests: make one rank raise, die or hang at a given step.

Set ``DS_SEQPAR_FAULT="<rank>:<step>:<raise|kill|hang>"`` in the environment of a training run;
unset (the normal case) it does nothing. It exists so the tests can prove that a failing rank
stops the whole run within the collective timeout instead of leaving its peers waiting forever.
"""
from __future__ import annotations

import os
import signal
import time

ENV = "DS_SEQPAR_FAULT"
MODES = ("raise", "kill", "hang")


class InjectedFault(RuntimeError):
    pass


def parse(spec: str):
    try:
        rank, step, mode = spec.split(":")
        rank, step = int(rank), int(step)
    except ValueError:
        raise ValueError(f"{ENV}={spec!r} must be '<rank>:<step>:<mode>' with mode one of {', '.join(MODES)}") from None
    if mode not in MODES:
        raise ValueError(f"{ENV}={spec!r}: mode {mode!r} is not one of {', '.join(MODES)}")
    return rank, step, mode


def maybe_inject(rank: int, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault_rank, fault_step, mode = parse(spec)
    if (rank, step) != (fault_rank, fault_step):
        return
    if mode == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at step {step} ({ENV})")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:          # hang: never returns; peers must time out
        time.sleep(3600)
