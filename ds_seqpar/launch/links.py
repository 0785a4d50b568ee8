"""Cutting this process's links to its peers, on the failure path.

A rank whose collective failed waits a while to hear from its peers (train/census.py) before
it exits. A peer blocked in a collective with it would wait the whole collective timeout to notice
(gloo raises "Connection closed by peer" only once the socket closes), report too late to be
heard, and be named as unresponsive although it was only waiting. Shutting this process's peer
sockets first makes every such collective fail at once, so the survivors all reach the census
within about a second of each other. The rendezvous store's connections (MASTER_PORT, at either
end: rank 0 may host the store) are kept: the census runs through them.
"""
from __future__ import annotations

import os
import socket
from typing import Mapping


def _ports(s: socket.socket) -> set:
    ports = {s.getsockname()[1]}
    try:
        ports.add(s.getpeername()[1])
    except OSError:          # not connected (a listening socket): nothing to cut
        return set()
    return ports


def sever_peer_links(env: Mapping[str, str]) -> int:
    """Shut down (both ways) every connected TCP socket of this process that is not the store's;
    returns how many. Linux only (reads /proc/self/fd); elsewhere does nothing."""
    keep = int(env.get("MASTER_PORT", "0") or 0)
    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        return 0
    cut = 0
    for name in os.listdir(fd_dir):
        try:
            if not os.readlink(f"{fd_dir}/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue
        try:     # the socket object only borrows the descriptor: detach() below, never close()
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                ports = _ports(s)
                if ports and keep not in ports:
                    s.shutdown(socket.SHUT_RDWR)
                    cut += 1
        except OSError:
            pass
        finally:
            s.detach()
    return cut
