"""Closed forms of the bytes one rank sends for one forward + backward, for every strategy: the one
oracle. The benchmark prints measured / closed form (must be 1.000), and each strategy family's
distributed test (tests/dist/test_ulysses.py, test_ring.py, test_lasp.py) asserts ``sp.stats``
against ``closed_form_by_kind`` on real ranks, so a strategy that starts sending more than its
design note says fails loudly.

Each form is the one in the strategy's docstring (strategies/*.py); the notation is theirs:

    P        sequence-parallel size (U x R for the 2D hybrid)
    S        elements of one local full-head tensor        [b, n, H, d]      n = N / P
    S_kv     elements of the local k (= of v when dv = d)  [b, n, H_kv, d]
    e        element size of q, k, v; e_acc = 4 (the ring's fp32 dK/dV accumulators)
    f        Ulysses k/v head replication P / gcd(H_kv, P) (1 when P divides H_kv)

Forms are split by the CommStats kind each exchange records under ("all_to_all", "ring",
"ring_grad", "lasp_state", "lasp_dstate"), so a test also sees which exchange is off.

Packed documents: Ulysses and the hybrid's all-to-alls are unchanged; the ring loop's K/V and
dK/dV go only where a document needs them (ring_document_bytes), LASP's states only across rank
boundaries a document crosses (lasp_document_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from . import RING_STRATEGIES
from .ulysses import kv_replication

E_ACC = 4            # ring dK/dV accumulators are fp32 whatever the input dtype (ring_loop.py)


@dataclass(frozen=True)
class Shapes:
    """One attention call over the whole sequence: batch, global length, heads, head dims, element size."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    elem: int = 4                       # bytes per element of q, k, v (fp32: 4, bf16: 2, fp64: 8)
    v_head_dim: Optional[int] = None    # None: = head_dim

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def local(self, p: int) -> "Shapes":
        return Shapes(self.batch, self.seq // p, self.heads, self.kv_heads, self.head_dim, self.elem,
                      self.v_head_dim)

    def elements(self, heads: int, dim: int) -> int:
        return self.batch * self.seq * heads * dim


def _all_to_all(p: int, loc: Shapes, f: int) -> int:
    """Ulysses inside ``p`` ranks on these local shapes: q, k, v, out forward and dout, dq, dk, dv
    backward, each all-to-all keeping 1/p of its tensor at home; k, v (and their grads) f-replicated."""
    tensors = (loc.elements(loc.heads, loc.head_dim), loc.elements(loc.heads, loc.dv),        # q / dq, out / dout
               f * loc.elements(loc.kv_heads, loc.head_dim), f * loc.elements(loc.kv_heads, loc.dv))  # k / dk, v / dv
    return sum(2 * (t * loc.elem * (p - 1) // p) for t in tensors)


def _ring(p: int, kv_elems: int, elem: int) -> Dict[str, int]:
    """K/V (S_k + S_v elements) forward P-1 hops and again backward P-1 hops; fp32 dK/dV P-1 hops."""
    return {"ring": kv_elems * (p - 1) * 2 * elem, "ring_grad": kv_elems * (p - 1) * E_ACC}


def ulysses_bytes(p: int, sh: Shapes) -> Dict[str, int]:
    """8 all-to-alls: 8 e S (P-1)/P for MHA."""
    return {"all_to_all": _all_to_all(p, sh.local(p), kv_replication(sh.heads, sh.kv_heads, p))}


def ring_bytes(p: int, sh: Shapes) -> Dict[str, int]:
    """Ring, zigzag, striped: S_kv (P-1) (4e + 2 e_acc) when dv = d."""
    loc = sh.local(p)
    return _ring(p, loc.elements(sh.kv_heads, sh.head_dim + sh.dv), sh.elem)


def hybrid_bytes(p: int, sh: Shapes, ulysses_size: int) -> Dict[str, int]:
    """Ulysses inside groups of U ranks, the ring form across R = P/U groups on the head-sharded,
    U-times-longer k (whose elements equal f * S_kv)."""
    u, r = ulysses_size, p // ulysses_size
    loc, f = sh.local(p), kv_replication(sh.heads, sh.kv_heads, ulysses_size)
    out = {"all_to_all": _all_to_all(u, loc, f)}
    out.update(_ring(r, f * loc.elements(sh.kv_heads, sh.head_dim + sh.dv), sh.elem))
    return out


def lasp_state_bytes(sh: Shapes) -> int:
    """One [b, H, Dk, Dv] state: fp32 (fp64 for fp64 inputs), one per q head."""
    return sh.batch * sh.heads * sh.head_dim * sh.dv * (8 if sh.elem == 8 else 4)


def lasp_bytes(p: int, sh: Shapes, rank: int, lasp_comm: str) -> Dict[str, int]:
    """LASP-1 ("ring"): one state forward to r+1, one dstate backward to r-1.
    LASP-2 ("allgather"): all-gather (P-1 states) + reduce-scatter ((P-1)/P of P states).
    Independent of the sequence length."""
    state = lasp_state_bytes(sh)
    if lasp_comm == "ring":
        return {"lasp_state": state * (rank < p - 1), "lasp_dstate": state * (rank > 0)}
    return {"lasp_state": state * (p - 1), "lasp_dstate": state * (p - 1)}


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


def ring_document_bytes(needs: List[List[bool]], me: int, kv_elems: int, elem: int) -> Dict[str, int]:
    """Bytes ring position ``me`` sends for one fwd+bwd with packed documents (transport.py: direct):
    its K/V to every rank that needs them, forward and backward; its fp32 share of dK/dV to every
    rank whose block it needs. ``kv_elems``: elements of the k and v the ring loop holds (S_k + S_v;
    f times that for the hybrid). Every pair needed: exactly _ring's form."""
    p = len(needs)
    needed_by = sum(needs[other][me] for other in range(p))
    uses = sum(needs[me][other] for other in range(p))
    return {"ring": needed_by * kv_elems * 2 * elem, "ring_grad": uses * kv_elems * E_ACC}


def _documents_by_kind(strategy: str, p: int, sh: Shapes, rank: int, ulysses_size: int, lasp_comm: str,
                       cu_seqlens: Sequence[int], causal: bool) -> Dict[str, int]:
    from ..sharding.documents import Documents
    from ..sharding.layouts import make_layout
    from . import get_strategy
    from .lasp_chain import LaspChain
    if strategy == "ulysses":
        return ulysses_bytes(p, sh)
    if strategy == "lasp":
        chain = LaspChain(p, sh.seq // p, Documents(cu_seqlens, sh.seq))
        return lasp_document_bytes(chain, rank, lasp_state_bytes(sh), lasp_comm)
    u, loc = ulysses_size, sh.local(p)
    f = kv_replication(sh.heads, sh.kv_heads, u) if u > 1 else 1
    ring = make_layout(get_strategy(strategy).layout_name, p // u)
    needs = ring_document_needs(cu_seqlens, ring, sh.seq, causal)
    out = {"all_to_all": _all_to_all(u, loc, f)} if u > 1 else {}
    out.update(ring_document_bytes(needs, rank // u, f * loc.elements(sh.kv_heads, sh.head_dim + sh.dv), sh.elem))
    return out


def lasp_document_bytes(chain, rank: int, state_bytes: int, lasp_comm: str) -> Dict[str, int]:
    """LASP with documents (lasp_chain.py): LASP-1 sends a state only across a boundary a document
    crosses (and its dstate back); LASP-2 keeps its collectives unless no document crosses any."""
    if lasp_comm == "ring":
        return {"lasp_state": state_bytes * chain.sends[rank], "lasp_dstate": state_bytes * chain.takes_in[rank]}
    both = state_bytes * (chain.p - 1) * chain.any_state_travels
    return {"lasp_state": both, "lasp_dstate": both}


def closed_form_by_kind(strategy: str, p: int, shapes: Shapes, rank: int = 0, ulysses_size: int = 1,
                        lasp_comm: str = "allgather", cu_seqlens: Optional[Sequence[int]] = None,
                        causal: bool = True) -> Dict[str, int]:
    """{CommStats kind: bytes} rank ``rank`` of a sequence group of ``p`` ranks sends for one
    fwd+bwd of one attention call over ``shapes`` (global length); kinds that send nothing are left
    out. ``ulysses_size`` > 1 with a ring strategy is the 2D hybrid, as in the config key;
    ``lasp_comm`` picks LASP-1 (ring) or LASP-2 (allgather). ``cu_seqlens``: packed documents over
    shapes.seq tokens (the padded length; ``causal`` matters to the ring family then)."""
    if strategy not in ("lasp", "ulysses") + RING_STRATEGIES:
        raise ValueError(f"no closed form for strategy {strategy!r}; known: lasp, ulysses, "
                         f"{', '.join(RING_STRATEGIES)}")
    if p == 1:
        return {}
    if cu_seqlens is not None:
        out = _documents_by_kind(strategy, p, shapes, rank, ulysses_size, lasp_comm, list(cu_seqlens), causal)
    elif strategy == "lasp":
        out = lasp_bytes(p, shapes, rank, lasp_comm)
    elif strategy == "ulysses":
        out = ulysses_bytes(p, shapes)
    else:
        out = hybrid_bytes(p, shapes, ulysses_size) if ulysses_size > 1 else ring_bytes(p, shapes)
    return {kind: n for kind, n in out.items() if n}


def closed_form_bytes(strategy: str, p: int, shapes: Shapes, rank: int = 0, ulysses_size: int = 1,
                      lasp_comm: str = "allgather", cu_seqlens: Optional[Sequence[int]] = None,
                      causal: bool = True) -> int:
    """The total of ``closed_form_by_kind``: what CommStats.total_bytes must read (with packed
    documents, less the "cu_seqlens_check" all-reduce of three int64 per call)."""
    return sum(closed_form_by_kind(strategy, p, shapes, rank, ulysses_size, lasp_comm, cu_seqlens, causal).values())


__all__ = ["Shapes", "closed_form_bytes", "closed_form_by_kind", "kv_replication", "E_ACC", "ring_document_needs",
           "ring_document_bytes", "lasp_document_bytes"]
