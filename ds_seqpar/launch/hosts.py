"""Which host every rank runs on, gathered once at start.

The failure path names the hosts of ranks that stopped answering (their logs, if any, are there),
run.json records them, and the topology checks the launcher's local ranks against them. Gathered
while every rank is still reachable: after a failure nothing can be asked of a lost host.
"""
from __future__ import annotations

import os
import socket
from typing import Dict, List, Mapping, Optional, Sequence

from .. import comm

# one entry per global rank: {"host": hostname, "addr": the address it reaches the rendezvous from,
# "local_world_size": how many ranks its launcher says share its host (None: not said)}
_HOSTS: List[Dict] = []


def this_host(env: Mapping[str, str]) -> Dict:
    """This process's hostname, the local address on its route to MASTER_ADDR (the interface its
    peers reach it on; no packet is sent: connecting a UDP socket only picks the route), and the
    launcher's LOCAL_WORLD_SIZE (launch/env.py sets it from every launcher's own variables)."""
    addr = ""
    master = env.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(env.get("MASTER_PORT", "29500"))))
                addr = s.getsockname()[0]
        except (OSError, ValueError):
            addr = ""
    local = env.get("LOCAL_WORLD_SIZE")
    return {"host": socket.gethostname(), "addr": addr, "local_world_size": int(local) if local else None}


def gather(env: Optional[Mapping[str, str]] = None) -> List[Dict]:
    """Collective (every rank, once, after joining the world): every rank's host, in rank order."""
    _HOSTS[:] = comm.gather_object(this_host(os.environ if env is None else env))
    return list(_HOSTS)


def known() -> List[Dict]:
    """The map gathered at start ([] before gather())."""
    return list(_HOSTS)


def where(ranks: Sequence[int], hosts: Optional[Sequence[Mapping[str, str]]] = None) -> str:
    """'host b (10.0.0.2): ranks 2, 3' per host, or '' when the map is not known."""
    hosts = known() if hosts is None else hosts
    if not ranks or len(hosts) <= max(ranks):
        return ""
    by_host: Dict[tuple, List[int]] = {}
    for r in ranks:
        by_host.setdefault((hosts[r]["host"], hosts[r]["addr"]), []).append(r)
    return "; ".join(f"host {h}" + (f" ({a})" if a else "") + f": rank(s) {', '.join(map(str, rs))}"
                     for (h, a), rs in by_host.items())


def ranks_at(address: str, hosts: Optional[Sequence[Mapping[str, str]]] = None) -> List[int]:
    """The ranks whose host is named or addressed ``address`` (e.g. MASTER_ADDR: the store's host)."""
    hosts = known() if hosts is None else hosts
    return [r for r, h in enumerate(hosts) if address in (h["host"], h["addr"])]
