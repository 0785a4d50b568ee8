"""All-Scan (ZeCO), lasp_comm "allscan": the third state exchange (ring.py has LASP-1, allgather.py
LASP-2, this package's __init__ the protocol all three keep). One running state goes through the
fragments in global order as LASP-1's does, but every owner has its B before the state comes and the
state travels in K blocks, so an owner forwards block k of A . S_in + B as soon as block k of S_in came:
a hop waits for one block, not for the owner's local work, and the bytes per rank are one state each
way, whatever P.

The blocks are value columns (the state's last dimension; the one before it where that has a single
entry, Mamba-1's [.., N, 1] with its diagonal decay): the delta rule's K x K transition acts on S's
columns one by one, so a block of columns maps to the same columns and no transition travels.
Backward walks back in reverse order the same way, dS_in[k] = G[k] + A^T dS_out[k] leaving as soon as
dS_out[k] came; dA = dS_out S_in^T is local (the ring's).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import Tensor

from ... import comm
from ..lasp_chain import Key
from .common import DSTATE, STATE, Transition
from .ring import RingStates


def scan_blocks(p: int, columns: int, state_bytes: int) -> int:
    """All-Scan's block count K for a state of ``state_bytes`` cut along a dimension of ``columns``
    entries. One running state crosses P - 1 hops; in K blocks the last one leaves the last rank after
    P - 2 + K block hops of alpha + S / (K beta) each, which is least at K = sqrt((P - 2) S / (alpha beta)):
    1 at P = 2 (one hop has nothing to pipeline, every extra block costs a latency), more the larger the
    state is against what a link moves in one latency. alpha beta is taken as LINK_BYTES (the ranks do not
    know their link; cost/times.py prices this K with the link's own alpha and beta); at most
    MAX_SCAN_BLOCKS and ``columns``."""
    if p <= 2:
        return 1
    k = round(((p - 2) * state_bytes / LINK_BYTES) ** 0.5)
    return max(1, min(k, MAX_SCAN_BLOCKS, columns))


LINK_BYTES = 256 << 10      # assumed alpha x beta: ~10 us x 25 GB/s (NVLink moves more, a TCP loopback less)
MAX_SCAN_BLOCKS = 16


class ScannedStates(RingStates):
    """All-Scan over RingStates' chain, messages and carries (module doc); K = scan_blocks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        matrix = self.maps.travels and self.maps.a_f.shape[-1] != 1
        self.dim = -1 if self.like.shape[-1] > 1 or matrix else -2       # a matrix acts on whole columns only
        size = self.like.shape[self.dim]
        self.k = scan_blocks(self.chain.p, size, self.like.numel() * self.like.element_size())
        cuts = torch.tensor_split(torch.arange(size), self.k)
        self.spans = [(int(c[0]), int(c[-1]) + 1) for c in cuts]
        self._b: Dict[int, Tensor] = {}

    def needs_local_state(self, j: int) -> bool:
        return self.feeds(j)                    # B is folded in block by block as the state passes

    def _blocks(self, t: Tensor) -> List[Tensor]:
        return [t.narrow(self.dim, lo, hi - lo) for lo, hi in self.spans]

    def _block_map(self, whole: Transition, k: int) -> Transition:
        """Block k's share of a transition: A itself for a matrix (it acts on columns) or a broadcast
        decay, else the decay's entries of the block."""
        a = whole.a
        if a is not None and a.shape[-1] == 1 and a.shape[self.dim] != 1:
            lo, hi = self.spans[k]
            a = a.narrow(self.dim, lo, hi - lo)
        return Transition(a)

    def _post_blocks(self, j: int, peer: Key, kind: str) -> None:
        if peer[0] == self.r:
            return
        for k, part in enumerate(self._blocks(self.like)):
            if (j, k) not in self._recvs:
                self._recvs[j, k] = self.posted(comm.p2p([], [(torch.empty_like(part), peer[0])], self.group,
                                                         self.stats, kind))

    def _take_block(self, j: int, k: int, peer: Key, kind: str) -> Tensor:
        if peer[0] == self.r:
            return self._carry.pop((j, k))
        return self._recvs.pop((j, k)).wait()[0]       # _relay posted every block's receive

    def _send_block(self, t: Tensor, to: Key, k: int, kind: str) -> None:
        if to[0] == self.r:
            self._carry[to[1], k] = t
        else:
            self._sends.append(self.posted(comm.p2p([(t.contiguous(), to[0])], [], self.group, self.stats, kind)))

    def _relay(self, j: int, peer: Key, to: Optional[Key], fold, kind: str) -> Tensor:
        """Block by block: take block k from ``peer``, send ``fold(k, block)`` to ``to`` (None: nobody
        reads it) at once; returns the whole state taken."""
        self._post_blocks(j, peer, kind)                # those post() did not post yet
        got = []
        for k in range(self.k):
            got.append(self._take_block(j, k, peer, kind))
            if to is not None:
                self._send_block(fold(k, got[-1]), to, k, kind)
        return got[0] if self.k == 1 else torch.cat(got, self.dim)

    def post(self, b: Dict[int, Tensor]) -> None:
        self._b = b
        mine = self.chain.local(self.r)
        for j in mine:                          # unfed fragments' B leaves at once
            if self.feeds(j) and not self.fed(j):
                for k, part in enumerate(self._blocks(b[j])):
                    self._send_block(part, self.chain.next[self.r, j], k, STATE)
        first_fed = next((j for j in mine if self.fed(j)), None)
        if first_fed is not None:               # posted before the local work, which it overlaps
            self._post_blocks(first_fed, self.chain.prev[self.r, first_fed], STATE)

    def state_in(self, j: int) -> Optional[Tensor]:
        if not self.fed(j):
            return None
        to = self.chain.next[self.r, j] if self.feeds(j) else None
        b = self._blocks(self._b[j]) if to is not None else None
        a = self.transition((self.r, j))
        return self._relay(j, self.chain.prev[self.r, j], to, lambda k, s: self._block_map(a, k).apply(s) + b[k], STATE)

    def pass_on(self, j: int, state_after: Tensor) -> None:
        pass                                    # every block went on as it came (state_in)

    def post_dstate(self, g: Dict[int, Tensor]) -> None:
        self._g = g
        mine = self.chain.local(self.r)
        for j in reversed(mine):                # dS_in is G alone: it leaves before the local work
            if self.fed(j) and not self.feeds(j):
                for k, part in enumerate(self._blocks(g[j])):
                    self._send_block(part, self.chain.prev[self.r, j], k, DSTATE)
        last_feeding = next((j for j in reversed(mine) if self.feeds(j)), None)
        if last_feeding is not None:
            self._post_blocks(last_feeding, self.chain.next[self.r, last_feeding], DSTATE)

    def dstate_out(self, j: int) -> Optional[Tensor]:
        """dS_out of local fragment j; a fed fragment sends dS_in[k] = G[k] + A^T dS_out[k] back per block."""
        if not self.feeds(j):
            return None
        to = self.chain.prev[self.r, j] if self.fed(j) else None
        g = self._blocks(self._g[j]) if to is not None else None
        a = self.transition((self.r, j))
        return self._relay(j, self.chain.next[self.r, j], to, lambda k, d: g[k] + self._block_map(a, k).transpose(d),
                           DSTATE)


__all__ = ["LINK_BYTES", "MAX_SCAN_BLOCKS", "ScannedStates", "scan_blocks"]
