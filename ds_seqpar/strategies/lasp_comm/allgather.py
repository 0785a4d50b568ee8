"""lasp_comm "allgather" (LASP-2). Forward: all-gather every rank's slots (the B of each fragment that feeds
another; A too where it travels), then fold each local fragment's chain: S_in = A_c1 ... B_cn + ... + B_c1
(c1 nearest). Backward, the dual collective: walk each chain with A^T, putting each source's share of dB
(and dA) in its owner's slot of a [P, slots, ...] buffer; a reduce-scatter sums them home.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import Tensor

from ... import comm
from ..lasp_chain import Key
from .common import DSTATE, STATE, ExchangeBase, Transition


class GatheredStates(ExchangeBase):
    """LASP-2: all-gather the slots, fold locally; backward reduce-scatters the dual."""

    _gathered = _dmaps = None

    def needs_local_state(self, j: int) -> bool:
        return self.feeds(j)                    # every slot goes out with the all-gather

    def _stack(self, per_slot: Dict[int, Tensor], like: Tensor) -> Tensor:
        """[width, ...] of this rank's slots, zeros where it holds fewer than the widest rank."""
        rows = [per_slot[j] for j in self.chain.slots[self.r]]
        rows += [torch.zeros_like(like)] * (self.chain.width - len(rows))
        return torch.stack(rows)

    def post(self, b: Dict[int, Tensor]) -> None:
        if not self.chain.width:                 # the same on every rank: all join the collective or none
            return
        pending = [self.posted(comm.all_gather_async(self._stack(b, self.like), self.group, self.stats, STATE))]
        if self.maps.travels:
            a = {j: self.maps.a_f[j] for j in self.chain.slots[self.r]}
            pending.append(self.posted(comm.all_gather_async(self._stack(a, self.maps.a_f[0]), self.group,
                                                             self.stats, STATE)))
        self._pending = pending

    def _wait_gathered(self):
        if self._gathered is None:
            self._gathered = [p.wait() for p in self._pending]      # b (and a): per rank [width, ...]
        return self._gathered

    def _b(self, key: Key) -> Tensor:
        return self._wait_gathered()[0][key[0]][self.chain.slot(key)]

    def _a(self, key: Key) -> Transition:
        return self.transition(key, self._wait_gathered()[1] if self.maps.travels else None)

    def entering(self, chain: List[Key]) -> List[Tensor]:
        """The states entering each fragment of ``chain`` (nearest first) and, last, the one after
        the nearest: the fold from the farthest, which starts from zero."""
        s, out = None, []
        for src in reversed(chain):
            out.append(s)
            s = self._b(src) if s is None else self._a(src).apply(s) + self._b(src)
        return out[::-1] + [s]

    def state_in(self, j: int) -> Optional[Tensor]:
        if not self.fed(j):
            return None
        return self.entering(self.chain.chain_of((self.r, j)))[-1]

    def pass_on(self, j: int, state_after: Tensor) -> None:
        pass                                    # every slot already went out with the all-gather

    def post_dstate(self, g: Dict[int, Tensor]) -> None:
        """``g``: S_in's gradient of each local fed fragment (through its output only)."""
        if not self.chain.width:
            return
        p, width = self.chain.p, self.chain.width
        to_owner_b = self.like.new_zeros((p, width) + self.like.shape)
        to_owner_a = self.maps.a_f.new_zeros((p, width) + self.maps.a_f.shape[1:]) if self.maps.travels else None
        for j, d in g.items():
            chain = self.chain.chain_of((self.r, j))
            states = self.entering(chain) if self.maps.travels else None
            for i, src in enumerate(chain):
                to_owner_b[src[0], self.chain.slot(src)] += d
                if to_owner_a is not None and states[i] is not None:
                    to_owner_a[src[0], self.chain.slot(src)] += self._a(src).grad(d, states[i])
                if i + 1 < len(chain):
                    d = self._a(src).transpose(d)
        self._pending_d = [self.posted(comm.reduce_scatter_async(t, 0, self.group, self.stats, DSTATE))
                           for t in (to_owner_b, to_owner_a) if t is not None]

    def _wait_dmaps(self):
        if self._dmaps is None:
            self._dmaps = [p.wait()[0] for p in self._pending_d]    # [width, ...] summed over ranks
        return self._dmaps

    def dstate_out(self, j: int) -> Optional[Tensor]:
        """The gradient of the state after local fragment j (None if nobody reads it)."""
        if not self.chain.width or not self.feeds(j):
            return None
        return self._wait_dmaps()[0][self.chain.slot((self.r, j))]

    def dmap(self, j: int, d_out: Tensor, s_in: Tensor) -> Tensor:
        """dA of local fragment j (travelling transitions), given its dstate_out: the readers' shares."""
        return self._wait_dmaps()[1][self.chain.slot((self.r, j))]


__all__ = ["GatheredStates"]
