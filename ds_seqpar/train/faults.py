"""Fault injection for the reliability tests: make one rank raise, die or hang at a given step.

Set ``DS_SEQPAR_FAULT="<rank>:<step>:<raise|interrupt|kill|hang>"`` in the environment of a
training run (interrupt = KeyboardInterrupt, as Ctrl-C to that rank alone); unset (the normal
case) it does nothing. It exists so the tests can prove that a failing rank ends the whole run
within seconds, and a hung one within the collective timeout, instead of leaving its peers
waiting forever. The injecting rank says so on stderr with the time, so a test can measure
from the fault to the end of the job.
"""
from __future__ import annotations

import os
import signal
import sys
import time

ENV = "DS_SEQPAR_FAULT"
MODES = ("raise", "interrupt", "kill", "hang")


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
    sys.stderr.write(f"{ENV}: rank {rank} {mode} at step {step}, t={time.time():.3f}\n")
    sys.stderr.flush()
    if mode == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at step {step} ({ENV})")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:          # hang: never returns; peers must time out
        time.sleep(3600)
