"""The LASP state exchanges by ``lasp_comm`` name (the own LM's LASP and the hybrids' linear layers
look them up here): allgather (LASP-2) and ring (LASP-1) in state_exchange.py, allscan (All-Scan) in
state_scan.py."""
from __future__ import annotations

from ..errors import ConfigError
from .state_exchange import GatheredStates, RingStates
from .state_scan import ScannedStates

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
