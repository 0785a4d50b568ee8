"""The two facts every way of starting local ranks shares: a free port for the rendezvous, and
the env:// variables torch.distributed (and DeepSpeed) read to join the world."""
from __future__ import annotations

import socket
from typing import Dict, Optional


def free_port() -> int:
    """A TCP port nobody listens on right now (the master's rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, local_rank: Optional[int] = None,
             local_world_size: Optional[int] = None, master_addr: str = "127.0.0.1") -> Dict[str, str]:
    """The env:// block of one rank; on one machine the local rank is the global one."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(port)}


__all__ = ["free_port", "rank_env"]
