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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict

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


__all__ = ["Shapes", "closed_form_bytes", "kv_replication", "E_ACC"]
