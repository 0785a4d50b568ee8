"""Joining the world through MASTER_ADDR:MASTER_PORT, with an error that says what is wrong.

torch's rendezvous retries a connection it cannot make for the whole process-group timeout and then
raises a store error naming neither the variable nor the host it ran on; a name that does not
resolve fails only inside that retry loop. Several hosts make both likely (rank 0's hostname
unknown on another node, a firewall, the address of the wrong interface), so the name is resolved
first (an error within a second) and a rendezvous that fails is reported with the variables, this
host and the timeout key.
"""
from __future__ import annotations

import socket
from typing import Callable, Mapping


class RendezvousError(RuntimeError):
    """This rank could not join the world through MASTER_ADDR:MASTER_PORT."""


def _where(env: Mapping[str, str]) -> str:
    return (f"rank {env.get('RANK', '?')} on host {socket.gethostname()} "
            f"(MASTER_ADDR={env.get('MASTER_ADDR')!r}, MASTER_PORT={env.get('MASTER_PORT')!r})")


def check_resolves(env: Mapping[str, str]) -> None:
    """MASTER_ADDR must name an address this host can resolve; refused at once otherwise."""
    addr = env.get("MASTER_ADDR", "")
    try:
        socket.getaddrinfo(addr, int(env.get("MASTER_PORT", "29500")), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as e:
        raise RendezvousError(
            f"{_where(env)}: MASTER_ADDR does not resolve here ({e}); set it to rank 0's host as every "
            f"host can reach it (an address, or a name in every host's /etc/hosts or DNS)") from None


def join(init: Callable[[], None], env: Mapping[str, str], timeout_s: float) -> None:
    """Run ``init`` (the process-group setup); a rendezvous that fails names the variables, this host
    and ``sequence_parallel.timeout_s``."""
    check_resolves(env)
    try:
        init()
    except (RuntimeError, TimeoutError, ConnectionError) as e:
        # torch's DistNetworkError / DistStoreError are RuntimeErrors; a user error in init is not
        # caught here because init is only the process-group setup
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RendezvousError(
            f"{_where(env)}: could not join the rendezvous within sequence_parallel.timeout_s={timeout_s:g} s "
            f"({first}). Check that rank 0 started, that MASTER_ADDR is rank 0's address as this host "
            f"reaches it, and that MASTER_PORT is open between the hosts (docs/launchers.md, several hosts)"
            f"{_restart_hint(env)}") from e


def _restart_hint(env: Mapping[str, str]) -> str:
    """torchrun --max-restarts shares its rendezvous store with the ranks by default: a restarted round
    then reads the addresses the killed round left there and cannot connect."""
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (". Under torchrun --max-restarts start torchrun with --rdzv-backend c10d and "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment: with the shared store a restarted round "
                "reads the previous round's addresses")
    return ""
