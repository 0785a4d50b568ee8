"""The LASP state exchanges, one file per ``lasp_comm`` value: the own LM's linear attention (lasp.py)
and the hybrids' linear layers (linear_exchange.py) pass their states through one of them, in phases
that let the local work overlap the transfers. common.py has what they share: the transition A of each
fragment (S_out = A . S_in + B) and the base.

- allgather.py (LASP-2): every rank's slots all-gathered, each chain folded locally; backward, the dual
  reduce-scatter.
- ring.py (LASP-1): the state hops owner to owner in global order; backward walks the ring in reverse.
- allscan.py (All-Scan, ZeCO): the ring's order and bytes, but every owner has B before the state comes
  and the state travels in K blocks of value columns: an owner forwards block k of A . S_in + B as soon
  as block k of S_in came, so a hop waits for one block, not for the owner's work.

CommStats kinds "lasp_state" (forward) and "lasp_dstate" (backward) for all.

The phases, per local fragment j (the caller's order: global): forward ``post`` (the slots or the
first sends, receives posted), ``state_in(j)``, ``pass_on(j, A . S_in + B)`` (ring); backward
``post_dstate`` (the G's), ``dstate_out(j)``. ``overlap=False`` waits for each transfer as soon as it
is posted; the results are the same.
"""
from __future__ import annotations

from ...errors import ConfigError
from .allgather import GatheredStates
from .allscan import ScannedStates
from .ring import RingStates

EXCHANGES = {"allgather": GatheredStates, "ring": RingStates, "allscan": ScannedStates}


def exchange_for(lasp_comm: str):
    """The exchange class ``lasp_comm`` names; an unknown one (a caller that did not come through the
    config's own check) refused with the key, the value and the valid ones. Every transition kind
    (fixed, scalar, diagonal, matrix) runs under every exchange, so nothing else is refused. Called
    where the strategy and the linear exchange are set up: the same on every rank, before any transfer."""
    if lasp_comm not in EXCHANGES:
        raise ConfigError(f"sequence_parallel.lasp_comm={lasp_comm!r} is not valid; choose one of: "
                          f"{', '.join(EXCHANGES)}")
    return EXCHANGES[lasp_comm]


__all__ = ["EXCHANGES", "exchange_for"]
