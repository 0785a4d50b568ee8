"""The one LASP state exchange: the own LM's linear attention (lasp.py) and the hybrids' linear layers
(state_passing.py) pass their states through it, in phases that let the local work overlap the transfers.

Every fragment (lasp_chain.py) runs as an affine map of the state that enters it, S_out = A . S_in + B
(B: the fragment's state from zero; A: its *transition*). What A is, per family:

    fixed    lambda^n per head [H, 1, 1] for n tokens (LASP's own LM, MiniMax's lightning attention):
             every rank derives every fragment's A from its length, so no A travels
    scalar   a data-dependent decay per (row, head) [rows, H, 1, 1] (Mamba2 SSD)
    diagonal a data-dependent decay per (row, channel, state entry) [rows, C, N, 1] on a [rows, C, N, 1]
             state (Mamba-1's selective scan: as large as the state)
    matrix   [rows, H, K, K] (the delta rule: gated DeltaNet, KDA)

Transition gives apply (A . S), transpose (A^T . D) and grad (dA from dS_out and S_in).

Three exchanges, as ``lasp_comm`` names them; CommStats kinds "lasp_state" (forward) and "lasp_dstate"
(backward) for all:

- allgather (LASP-2). Forward: all-gather every rank's slots (the B of each fragment that feeds
  another; A too where it travels), then fold each local fragment's chain: S_in = A_c1 ... B_cn + ... +
  B_c1 (c1 nearest). Backward, the dual collective: walk each chain with A^T, putting each source's
  share of dB (and dA) in its owner's slot of a [P, slots, ...] buffer; a reduce-scatter sums them home.
- ring (LASP-1). Forward: fragments in global order, each owner receiving S_in from the previous one
  and sending A . S_in + B on (or B at once, for a fragment that is not fed). Backward walks back:
  the owner receives dS_out, sends dS_in = G + A^T dS_out (G: S_in's gradient through the output).
- allscan (All-Scan, ZeCO; state_scan.py). The ring's order and bytes, but every owner has B before the
  state comes and the state travels in K blocks of value columns: an owner forwards block k of
  A . S_in + B as soon as block k of S_in came, so a hop waits for one block, not for the owner's work.

exchanges.py looks them up by name.

The phases, per local fragment j (the caller's order: global): forward ``post`` (the slots or the
first sends, receives posted), ``state_in(j)``, ``pass_on(j, A . S_in + B)`` (ring); backward
``post_dstate`` (the G's), ``dstate_out(j)``. ``overlap=False`` waits for each transfer as soon as it
is posted; the results are the same.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .. import comm
from ..kernels.linear import state_decay
from .lasp_chain import Key, StatePlan

STATE, DSTATE = "lasp_state", "lasp_dstate"


class Transition:
    """A of one fragment: None (the identity: no decay), elementwise ([.., 1, 1] a scalar per head,
    [.., K, 1] a diagonal: one decay per state row) or a matrix [.., K, K]."""

    def __init__(self, a: Optional[Tensor]):
        self.a = a

    @property
    def _elementwise(self) -> bool:
        return self.a.shape[-1] == 1

    def apply(self, s: Tensor) -> Tensor:
        if self.a is None:
            return s
        return self.a * s if self._elementwise else self.a @ s

    def transpose(self, d: Tensor) -> Tensor:
        if self.a is None:
            return d
        return self.a * d if self._elementwise else self.a.transpose(-1, -2) @ d

    def grad(self, d_out: Tensor, s_in: Tensor) -> Tensor:
        """dA from dS_out and S_in: D S_in^T, or D * S_in summed over the dims A broadcasts along."""
        if not self._elementwise:
            return d_out @ s_in.transpose(-1, -2)
        prod = d_out * s_in
        dims = tuple(i for i in (-2, -1) if self.a.shape[i] == 1 and prod.shape[i] != 1)
        return prod.sum(dims, keepdim=True) if dims else prod


class FixedDecay:
    """The fixed transition: lambda^n per head for a fragment of n tokens (decay_h [H] or None)."""

    travels = False

    def __init__(self, decay_h: Optional[Tensor], dtype: torch.dtype):
        self.decay_h, self.dtype = decay_h, dtype

    def of_length(self, n: int) -> Transition:
        return Transition(state_decay(self.decay_h, n, self.dtype))       # [H, 1, 1], or None: no decay


class TravellingMaps:
    """A data-dependent transition (scalar, diagonal or matrix): this rank's A per local fragment, [nf, ...]."""

    travels = True

    def __init__(self, a_f: Tensor):
        self.a_f = a_f


class _Exchange:
    """What both exchanges share: the plan, this rank, the state's shape, and posting."""

    def __init__(self, plan: StatePlan, rank: int, group, stats, state_like: Tensor, maps, overlap: bool = True):
        self.plan, self.r, self.group, self.stats, self.overlap = plan, rank, group, stats, overlap
        self.like, self.maps = state_like, maps           # state_like: a template of one state (shape, dtype)
        self._sends: List = []

    def transition(self, key: Key, a_gathered=None) -> Transition:
        if not self.maps.travels:
            return self.maps.of_length(self.plan.tokens(key))
        if key[0] == self.r:
            return Transition(self.maps.a_f[key[1]])
        return Transition(a_gathered[key[0]][self.plan.slot(key)])

    def fed(self, j: int) -> bool:
        return self.plan.fed[self.r, j]

    def feeds(self, j: int) -> bool:
        return self.plan.feeds[self.r, j]

    def posted(self, pending):
        if not self.overlap:
            pending.wait()
        return pending

    def finish(self) -> None:
        for pending in self._sends:             # sends complete before their buffers go
            pending.wait()
        self._sends = []


class GatheredStates(_Exchange):
    """LASP-2: all-gather the slots, fold locally; backward reduce-scatters the dual."""

    _gathered = _dmaps = None

    def needs_local_state(self, j: int) -> bool:
        return self.feeds(j)                    # every slot goes out with the all-gather

    def _stack(self, per_slot: Dict[int, Tensor], like: Tensor) -> Tensor:
        """[width, ...] of this rank's slots, zeros where it holds fewer than the widest rank."""
        rows = [per_slot[j] for j in self.plan.slots[self.r]]
        rows += [torch.zeros_like(like)] * (self.plan.width - len(rows))
        return torch.stack(rows)

    def post(self, b: Dict[int, Tensor]) -> None:
        if not self.plan.width:                 # the same on every rank: all join the collective or none
            return
        pending = [self.posted(comm.all_gather_async(self._stack(b, self.like), self.group, self.stats, STATE))]
        if self.maps.travels:
            a = {j: self.maps.a_f[j] for j in self.plan.slots[self.r]}
            pending.append(self.posted(comm.all_gather_async(self._stack(a, self.maps.a_f[0]), self.group,
                                                             self.stats, STATE)))
        self._pending = pending

    def _wait_gathered(self):
        if self._gathered is None:
            self._gathered = [p.wait() for p in self._pending]      # b (and a): per rank [width, ...]
        return self._gathered

    def _b(self, key: Key) -> Tensor:
        return self._wait_gathered()[0][key[0]][self.plan.slot(key)]

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
        return self.entering(self.plan.chain_of((self.r, j)))[-1]

    def pass_on(self, j: int, state_after: Tensor) -> None:
        pass                                    # every slot already went out with the all-gather

    def post_dstate(self, g: Dict[int, Tensor]) -> None:
        """``g``: S_in's gradient of each local fed fragment (through its output only)."""
        if not self.plan.width:
            return
        p, width = self.plan.p, self.plan.width
        to_owner_b = self.like.new_zeros((p, width) + self.like.shape)
        to_owner_a = self.maps.a_f.new_zeros((p, width) + self.maps.a_f.shape[1:]) if self.maps.travels else None
        for j, d in g.items():
            chain = self.plan.chain_of((self.r, j))
            states = self.entering(chain) if self.maps.travels else None
            for i, src in enumerate(chain):
                to_owner_b[src[0], self.plan.slot(src)] += d
                if to_owner_a is not None and states[i] is not None:
                    to_owner_a[src[0], self.plan.slot(src)] += self._a(src).grad(d, states[i])
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
        if not self.plan.width or not self.feeds(j):
            return None
        return self._wait_dmaps()[0][self.plan.slot((self.r, j))]

    def dmap(self, j: int, d_out: Tensor, s_in: Tensor) -> Tensor:
        """dA of local fragment j (travelling transitions), given its dstate_out: the readers' shares."""
        return self._wait_dmaps()[1][self.plan.slot((self.r, j))]


class RingStates(_Exchange):
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
        mine = self.plan.local(self.r)
        first_fed = next((j for j in mine if self.fed(j)), None)
        if first_fed is not None:               # posted before the local work, which it overlaps
            self._post_recv(first_fed, self.plan.prev[self.r, first_fed], STATE)
        for j in mine:
            if self.needs_local_state(j):
                self._send(b[j], self.plan.next[self.r, j], STATE)

    def state_in(self, j: int) -> Optional[Tensor]:
        return self._take(j, self.plan.prev[self.r, j], STATE) if self.fed(j) else None

    def pass_on(self, j: int, state_after: Tensor) -> None:
        if self.fed(j) and self.feeds(j):
            self._send(state_after, self.plan.next[self.r, j], STATE)

    def post_dstate(self, g: Dict[int, Tensor]) -> None:
        self._g = g
        mine = self.plan.local(self.r)
        last_feeding = next((j for j in reversed(mine) if self.feeds(j)), None)
        if last_feeding is not None:
            self._post_recv(last_feeding, self.plan.next[self.r, last_feeding], DSTATE)
        for j in reversed(mine):                # dS_in is G alone: it leaves before the local work
            if self.fed(j) and not self.feeds(j):
                self._send(g[j], self.plan.prev[self.r, j], DSTATE)

    def dstate_out(self, j: int) -> Optional[Tensor]:
        """dS_out of local fragment j; a fed fragment then sends dS_in = G + A^T dS_out back."""
        if not self.feeds(j):
            return None
        d_out = self._take(j, self.plan.next[self.r, j], DSTATE)
        if self.fed(j):
            self._send(self._g[j] + self.transition((self.r, j)).transpose(d_out), self.plan.prev[self.r, j], DSTATE)
        return d_out

    def dmap(self, j: int, d_out: Tensor, s_in: Tensor) -> Tensor:
        """dA of local fragment j (travelling transitions): dS_out against the S_in it entered with."""
        return self.transition((self.r, j)).grad(d_out, s_in)


__all__ = ["GatheredStates", "RingStates", "Transition", "FixedDecay", "TravellingMaps",
           "STATE", "DSTATE"]
