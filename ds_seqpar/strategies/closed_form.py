"""Closed forms of the bytes one rank sends for one forward + backward, for every strategy, in one
place. The benchmark prints measured / closed form (must be 1.000) and tests/test_bench.py checks
each form against ``sp.stats`` on real ranks, so a strategy that starts sending more than its
design note says fails loudly.

Each form is the one in the strategy's docstring (strategies/*.py); the notation is theirs:

    P        sequence-parallel size (U x R for the 2D hybrid)
    S        elements of one local full-head tensor        [b, n, H, d]      n = N / P
    S_kv     elements of the local k (= of v)              [b, n, H_kv, d]
    e        element size of q, k, v; e_acc = 4 (the ring's fp32 dK/dV accumulators)
    f        Ulysses k/v head replication P / gcd(H_kv, P) (1 when P divides H_kv)

Packed documents: Ulysses and the hybrid's all-to-alls are unchanged; the ring loop's K/V and
dK/dV go only where a document needs them (ring_document_bytes), LASP's states only across rank
boundaries a document crosses (lasp_document_bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

E_ACC = 4            # ring dK/dV accumulators are fp32 whatever the input dtype (ring_loop.py)


@dataclass(frozen=True)
class Shapes:
    """One attention call over the whole sequence: batch, global length, heads, head dim, element size."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    elem: int = 4            # bytes per element of q, k, v (fp32: 4, bf16: 2, fp64: 8)

    def local(self, p: int) -> "Shapes":
        return Shapes(self.batch, self.seq // p, self.heads, self.kv_heads, self.head_dim, self.elem)

    @property
    def elems(self) -> int:          # S of these shapes
        return self.batch * self.seq * self.heads * self.head_dim

    @property
    def kv_elems(self) -> int:       # S_kv of these shapes
        return self.batch * self.seq * self.kv_heads * self.head_dim


def kv_replication(heads: int, kv_heads: int, size: int) -> int:
    """f: how often Ulysses repeats each k/v head so the k/v heads split over ``size`` ranks."""
    return size // math.gcd(kv_heads, size)


def ulysses_bytes(p: int, sh: Shapes) -> int:
    """q, out, dout, dq and (f-replicated) k, v, dk, dv: each all-to-all keeps 1/P at home."""
    loc, f = sh.local(p), kv_replication(sh.heads, sh.kv_heads, p)
    return (4 * loc.elems + 4 * f * loc.kv_elems) * sh.elem * (p - 1) // p


def ring_bytes(p: int, sh: Shapes) -> int:
    """K/V forward (P-1 hops), K/V again backward (P-1), fp32 dK/dV (P-1): ring, zigzag, striped."""
    return sh.local(p).kv_elems * (p - 1) * (4 * sh.elem + 2 * E_ACC)


def hybrid_bytes(p: int, sh: Shapes, ulysses_size: int) -> int:
    """Ulysses inside groups of U ranks, the ring form across R = P/U groups on the head-sharded,
    U-times-longer k (whose elements equal f * S_kv)."""
    u, r = ulysses_size, p // ulysses_size
    loc, f = sh.local(p), kv_replication(sh.heads, sh.kv_heads, u)
    a2a = (4 * loc.elems + 4 * f * loc.kv_elems) * sh.elem * (u - 1) // u
    return a2a + f * loc.kv_elems * (r - 1) * (4 * sh.elem + 2 * E_ACC)


def lasp_state_bytes(sh: Shapes) -> int:
    """One [b, H, Dk, Dv] state: fp32 (fp64 for fp64 inputs), one per q head."""
    return sh.batch * sh.heads * sh.head_dim * sh.head_dim * (8 if sh.elem == 8 else 4)


def lasp_bytes(p: int, sh: Shapes, rank: int, lasp_comm: str) -> int:
    """LASP-1 ("ring"): one state forward to r+1, one dstate backward to r-1.
    LASP-2 ("allgather"): all-gather (P-1 states) + reduce-scatter ((P-1)/P of P states).
    Independent of the sequence length."""
    if lasp_comm == "ring":
        return lasp_state_bytes(sh) * ((rank < p - 1) + (rank > 0))
    return lasp_state_bytes(sh) * 2 * (p - 1)


# -- packed documents (cu_seqlens) -------------------------------------------------------------


def ring_document_needs(bounds: Sequence[int], ring_layout, padded: int, causal: bool) -> List[List[bool]]:
    """needs[me][src] (me != src): ring position me computes on src's K/V block, i.e. some document
    has a key in src at or before (causal) one of its queries in me. From each document's first and
    last token on each rank, independently of the sub-block decomposition (varlen.py)."""
    p = ring_layout.size
    span = []                                        # span[r][d] = (first, last) global position of d on r
    for r in range(p):
        g = ring_layout.indices(padded, r)
        g = g[g < bounds[-1]]                        # end padding belongs to no document
        doc = torch.searchsorted(torch.tensor(bounds), g, right=True) - 1
        span.append({int(d): (int(g[doc == d].min()), int(g[doc == d].max())) for d in doc.unique()})
    return [[me != src and any(not causal or span[src][d][0] <= span[me][d][1]
                               for d in span[me].keys() & span[src].keys())
             for src in range(p)] for me in range(p)]


def ring_document_bytes(needs: List[List[bool]], me: int, block_kv_elems: int, elem: int) -> Dict[str, int]:
    """Bytes ring position ``me`` sends for one fwd+bwd with packed documents (transport.py: direct):
    its K/V to every rank that needs them, forward and backward; its fp32 share of dK/dV to every
    rank whose block it needs. ``block_kv_elems``: elements of the k the ring loop holds (S_kv;
    f*S_kv for the hybrid). Every pair needed: exactly ring_bytes."""
    p = len(needs)
    needed_by = sum(needs[other][me] for other in range(p))
    uses = sum(needs[me][other] for other in range(p))
    return {"ring": needed_by * 2 * block_kv_elems * 2 * elem, "ring_grad": uses * 2 * block_kv_elems * E_ACC}


def lasp_document_bytes(chain, rank: int, state_bytes: int, lasp_comm: str) -> Dict[str, int]:
    """LASP with documents (lasp_chain.py): LASP-1 sends a state only across a boundary a document
    crosses (and its dstate back); LASP-2 keeps its collectives unless no document crosses any."""
    if lasp_comm == "ring":
        return {"lasp_state": state_bytes * chain.sends[rank], "lasp_dstate": state_bytes * chain.takes_in[rank]}
    both = state_bytes * (chain.p - 1) * chain.any_state_travels
    return {"lasp_state": both, "lasp_dstate": both}


_SOFTMAX: Dict[str, Callable[[int, Shapes], int]] = {
    "ulysses": ulysses_bytes, "ring": ring_bytes, "zigzag": ring_bytes, "striped": ring_bytes,
}


def closed_form_bytes(strategy: str, p: int, shapes: Shapes, rank: int = 0, ulysses_size: int = 1,
                      lasp_comm: str = "allgather") -> int:
    """Bytes rank ``rank`` of a sequence group of ``p`` ranks sends for one fwd+bwd of one
    attention call over ``shapes`` (global length). ``ulysses_size`` > 1 with a ring strategy is
    the 2D hybrid, as in the config key; ``lasp_comm`` picks LASP-1 (ring) or LASP-2 (allgather)."""
    if p == 1:
        return 0
    if strategy == "lasp":
        return lasp_bytes(p, shapes, rank, lasp_comm)
    if strategy not in _SOFTMAX:
        raise ValueError(f"no closed form for strategy {strategy!r}; known: lasp, {', '.join(sorted(_SOFTMAX))}")
    if ulysses_size > 1 and strategy != "ulysses":
        return hybrid_bytes(p, shapes, ulysses_size)
    return _SOFTMAX[strategy](p, shapes)


__all__ = ["Shapes", "closed_form_bytes", "kv_replication", "E_ACC", "ring_document_needs", "ring_document_bytes",
           "lasp_document_bytes"]
