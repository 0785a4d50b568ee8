"""lasp_comm "ring" (LASP-1). Forward: fragments in global order, each owner receiving S_in from the
previous one and sending A . S_in + B on (or B at once, for a fragment that is not fed). Backward walks
the ring in reverse: the owner receives dS_out, sends dS_in = G + A^T dS_out (G: S_in's gradient through
the output). allscan.py runs the same order and messages in blocks.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from ... import comm
from ..lasp_chain import Key
from .common import DSTATE, STATE, ExchangeBase


class RingStates(ExchangeBase):
    """LASP-1: states hop owner to owner in global order; backward walks the ring in reverse."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._recvs: Dict[int, object] = {}
        self._carry: Dict[int, Tensor] = {}     # a state (or gradient) between two fragments of this rank
        self._g: Dict[int, Tensor] = {}

    def needs_local_state(self, j: int) -> bool:
        return self.feeds(j) and not self.fed(j)   # its B leaves at once; fed ones send A . S_in + B

    def _send(self, t: Tensor, to: Key, kind: str) -> None:
        if to[0] == self.r:
            self._carry[to[1]] = t
        else:
            self._sends.append(self.posted(comm.p2p([(t.contiguous(), to[0])], [], self.group, self.stats, kind)))

    def _post_recv(self, j: int, peer: Key, kind: str) -> None:
        if j not in self._recvs and peer[0] != self.r:
            self._recvs[j] = self.posted(comm.p2p([], [(torch.empty_like(self.like), peer[0])], self.group,
                                                  self.stats, kind))

    def _take(self, j: int, peer: Key, kind: str) -> Tensor:
        if peer[0] == self.r:
            return self._carry.pop(j)
        self._post_recv(j, peer, kind)
        return self._recvs.pop(j).wait()[0]

    def post(self, b: Dict[int, Tensor]) -> None:
        mine = self.chain.local(self.r)
        first_fed = next((j for j in mine if self.fed(j)), None)
        if first_fed is not None:               # posted before the local work, which it overlaps
            self._post_recv(first_fed, self.chain.prev[self.r, first_fed], STATE)
        for j in mine:
            if self.needs_local_state(j):
                self._send(b[j], self.chain.next[self.r, j], STATE)

    def state_in(self, j: int) -> Optional[Tensor]:
        return self._take(j, self.chain.prev[self.r, j], STATE) if self.fed(j) else None

    def pass_on(self, j: int, state_after: Tensor) -> None:
        if self.fed(j) and self.feeds(j):
            self._send(state_after, self.chain.next[self.r, j], STATE)

    def post_dstate(self, g: Dict[int, Tensor]) -> None:
        self._g = g
        mine = self.chain.local(self.r)
        last_feeding = next((j for j in reversed(mine) if self.feeds(j)), None)
        if last_feeding is not None:
            self._post_recv(last_feeding, self.chain.next[self.r, last_feeding], DSTATE)
        for j in reversed(mine):                # dS_in is G alone: it leaves before the local work
            if self.fed(j) and not self.feeds(j):
                self._send(g[j], self.chain.prev[self.r, j], DSTATE)

    def dstate_out(self, j: int) -> Optional[Tensor]:
        """dS_out of local fragment j; a fed fragment then sends dS_in = G + A^T dS_out back."""
        if not self.feeds(j):
            return None
        d_out = self._take(j, self.chain.next[self.r, j], DSTATE)
        if self.fed(j):
            self._send(self._g[j] + self.transition((self.r, j)).transpose(d_out), self.chain.prev[self.r, j], DSTATE)
        return d_out

    def dmap(self, j: int, d_out: Tensor, s_in: Tensor) -> Tensor:
        """dA of local fragment j (travelling transitions): dS_out against the S_in it entered with."""
        return self.transition((self.r, j)).grad(d_out, s_in)


__all__ = ["RingStates"]
