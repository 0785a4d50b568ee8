"""The failure path's census: after a collective failed, each rank reports its own line under its rank in the
rendezvous store and reads what the others reported within a bounded wait, so a rank that lost its peers can
name who is gone (train/exits.py says it; launch/links.py and launch/hosts.py map the silent ranks to hosts).
Here, in train/, because it is the job's failure path, not a verb of the sequence-parallel layers (comm.py)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch.distributed as dist


@dataclass
class Census:
    """After a failure: rank -> the line it reported (``said``), the ranks that reported nothing in
    time (``silent``: dead, hung, cut off), and why the store could not be asked, if it could not."""
    said: Dict[int, str]
    silent: List[int]
    store_error: str = ""


_CENSUS_KEY = "ds_seqpar/failed"


def failure_census(what: str, wait_s: float) -> Optional[Census]:
    """After a failure, report ``what`` under this rank in the rendezvous store, then wait up to
    ``wait_s`` (0: not at all) for every other rank's report; None: no store. Not a collective:
    gloo's monitored barrier bounds only rank 0's wait, and raises before naming anyone once a
    peer's socket is closed; this is bounded on every rank, on any backend."""
    try:
        store = dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None
    except (RuntimeError, ValueError):
        store = None
    if store is None:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    said: Dict[int, str] = {}
    error: List[str] = []   # both filled by the asking thread
    # the store's client blocks without a timeout on a link that is cut (a check() waits forever
    # for its answer): asked from a thread that this one stops waiting for; the process ends soon
    asking = threading.Thread(target=_ask_store, args=(store, rank, world, what, wait_s, said, error), daemon=True)
    asking.start()
    asking.join(wait_s + 2.0)
    if asking.is_alive():
        error.append(f"no answer within {wait_s + 2.0:.0f}s")
    return Census(dict(said), [r for r in range(world) if r not in said], error[0] if error else "")


def _ask_store(store, rank: int, world: int, what: str, wait_s: float, said: Dict[int, str], error: List[str]):
    deadline = time.monotonic() + wait_s
    try:
        store.set(f"{_CENSUS_KEY}/{rank}", what)
        while True:
            for r in range(world):
                if r not in said and store.check([f"{_CENSUS_KEY}/{r}"]):
                    said[r] = store.get(f"{_CENSUS_KEY}/{r}").decode(errors="replace")
            if len(said) == world or time.monotonic() >= deadline:
                return
            time.sleep(0.2)
    except Exception as err:  # noqa: BLE001 - any store failure means: cannot be told further
        error.append(f"{type(err).__name__}: {err}")
