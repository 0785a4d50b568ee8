"""How a rank of the main job leaves: after training (the process group closed, then the process ended
without the interpreter's teardown) and on failure (its own error or a peer's, said once, with who is
gone from the census, then an exit the launcher sees within seconds)."""
from __future__ import annotations

import os
import sys
import time
import traceback

from .. import comm
from ..launch import hosts
from ..launch.links import sever_peer_links
from .census import failure_census


def leave_world() -> None:
    """End this process's part of the world after training. A process that exits with a live gloo
    group can abort in interpreter shutdown ("terminate called without an active exception": gloo's
    worker threads still hold work while Python is torn down), which the launcher reports as the
    job's failure after a run that trained to the end. The barrier keeps a rank from tearing down
    its links while a peer still finishes its last step's collectives."""
    if comm.is_initialized():
        comm.barrier()
        comm.destroy()


def exit_process(code: int) -> None:
    """End the command-line process with ``code`` once main() has returned: the exit handlers run
    (logging, wandb, torch's own), then the process ends without the interpreter's teardown of every
    module, which for torch + DeepSpeed is about 1.3 s of CPU per rank spent freeing objects the
    operating system frees at once. Everything this job writes is closed by then (the trainer's
    close, the process group left)."""
    import atexit
    _flush()
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def fail_rank(err: BaseException) -> int:
    """This rank's failure, said by this rank. A failed collective is a peer's failure seen from
    here: the census (census.py) finds out who is gone and where, within CENSUS_WAIT_S
    on every rank. This rank's own error goes to the census too (peers name it: its log may be on
    another host) and is said here with its traceback."""
    rank = os.environ.get("RANK", "?")
    what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    code = 130 if isinstance(err, KeyboardInterrupt) else 1
    if _is_comm_error(err):
        # peers blocked on this rank fail now, not after their timeout, and reach the census in time
        sever_peer_links(os.environ)
        hint = _comm_failure_hint(what)
        # the store lives in rank 0 under most launchers: it stays a moment for peers still asking it
        return fail(code, f"ds_seqpar.train: rank {rank} failed: {what}{hint}",
                     linger_s=1.0 if rank == "0" else 0.0)
    failure_census(f"{_OWN}{_one_line(what)}", wait_s=0)
    detail = "" if isinstance(err, KeyboardInterrupt) else traceback.format_exc()
    return fail(code, f"{detail}ds_seqpar.train: rank {rank} failed: {what}")


def fail(code: int, message: str, linger_s: float = 0.0) -> int:
    """Say the error as one write (so ranks' lines do not interleave), then leave. One rank of
    several leaves at once with os._exit: its peers may be blocked in a collective with it, an MPI
    runtime would hold a normal exit in MPI_Finalize until they time out, and interpreter shutdown
    with live gloo threads can abort; the launcher (mpirun, torchrun, deepspeed, spawn_local) sees
    the exit within a second or two and stops the other ranks."""
    _flush()
    if message:
        os.write(2, f"{message}\n".encode())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(linger_s)
        os._exit(code)
    return code


CENSUS_WAIT_S = 10.0     # how long a rank whose collective failed waits to hear from its peers
_OWN = "own error: "     # the census line of a rank that failed by itself (not through a peer)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def _comm_failure_hint(what: str) -> str:
    """Who is gone and on which host, from the census: the ranks that never answered and the ranks
    that failed by themselves, or the rendezvous store's host when the store cannot be reached."""
    census = failure_census(_one_line(what), wait_s=CENSUS_WAIT_S)
    me = comm.global_rank() if comm.is_initialized() else -1
    parts = []
    if census is not None and census.store_error:
        master = os.environ.get("MASTER_ADDR", "?")
        lost = [r for r in hosts.ranks_at(master) if r not in census.said]
        parts.append(f"the rendezvous store at {master}:{os.environ.get('MASTER_PORT', '?')} stopped "
                     f"answering ({_one_line(census.store_error, 120)})")
        if lost and me not in lost:
            parts.append(_named(lost, "unreachable"))
    elif census is not None:
        silent = [r for r in census.silent if r != me]
        if silent:
            parts.append(_named(silent, "stopped responding"))
        for r, line in sorted(census.said.items()):
            if line.startswith(_OWN):
                at = hosts.where([r])
                parts.append(f"rank {r} failed by itself{f' on {at}' if at else ''}: {line[len(_OWN):]}")
    if not parts:
        parts.append("another rank failed or stopped responding; its error is in that rank's own log")
    return f" (a collective failed or timed out: {'; '.join(parts)}; sequence_parallel.timeout_s bounds the wait)"


def _named(ranks, state: str) -> str:
    at = hosts.where(ranks)
    return f"rank(s) {', '.join(map(str, ranks))} {state}" + (f" [{at}]" if at else "")


def _is_comm_error(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "timeout", "connection", "distbackend", "peer"))


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


__all__ = ["CENSUS_WAIT_S", "exit_process", "fail", "fail_rank", "leave_world"]
