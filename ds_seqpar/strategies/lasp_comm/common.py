"""What every LASP state exchange (allgather.py, ring.py, allscan.py) shares: the transition A of each
fragment, the CommStats kinds, and the base that holds the chain, this rank and the posting.

Every fragment (strategies/lasp_chain.py) runs as an affine map of the state that enters it,
S_out = A . S_in + B (B: the fragment's state from zero; A: its *transition*). What A is, per family:

    fixed    lambda^n per head [H, 1, 1] for n tokens (LASP's own LM, MiniMax's lightning attention):
             every rank derives every fragment's A from its length, so no A travels
    scalar   a data-dependent decay per (row, head) [rows, H, 1, 1] (Mamba2 SSD)
    diagonal a data-dependent decay per (row, channel, state entry) [rows, C, N, 1] on a [rows, C, N, 1]
             state (Mamba-1's selective scan: as large as the state)
    matrix   [rows, H, K, K] (the delta rule: gated DeltaNet, KDA)

Transition gives apply (A . S), transpose (A^T . D) and grad (dA from dS_out and S_in).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ...kernels.linear import state_decay
from ..lasp_chain import Key, StateChain

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


class ExchangeBase:
    """What every exchange shares: the chain, this rank, the state's shape, and posting."""

    def __init__(self, chain: StateChain, rank: int, group, stats, state_like: Tensor, maps, overlap: bool = True):
        self.chain, self.r, self.group, self.stats, self.overlap = chain, rank, group, stats, overlap
        self.like, self.maps = state_like, maps           # state_like: a template of one state (shape, dtype)
        self._sends: List = []

    def transition(self, key: Key, a_gathered=None) -> Transition:
        if not self.maps.travels:
            return self.maps.of_length(self.chain.tokens(key))
        if key[0] == self.r:
            return Transition(self.maps.a_f[key[1]])
        return Transition(a_gathered[key[0]][self.chain.slot(key)])

    def fed(self, j: int) -> bool:
        return self.chain.fed[self.r, j]

    def feeds(self, j: int) -> bool:
        return self.chain.feeds[self.r, j]

    def posted(self, pending):
        if not self.overlap:
            pending.wait()
        return pending

    def finish(self) -> None:
        for pending in self._sends:             # sends complete before their buffers go
            pending.wait()
        self._sends = []


__all__ = ["ExchangeBase", "Transition", "FixedDecay", "TravellingMaps", "STATE", "DSTATE"]
