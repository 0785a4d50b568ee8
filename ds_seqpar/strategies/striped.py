"""Striped ring attention: rank r holds tokens r, r+P, r+2P, ... (local slot i = token i*P + r),
so causal work is balanced at token granularity.

Notation: P ring ranks, n = N / P local tokens, me = this rank's ring position, src = owner of
the K/V block held at a ring step (see ring_loop.py for the loop).

Math -> code. Local query i (token i*P + me) sees local key j (token j*P + src) iff
j*P + src <= i*P + me:

    src <= me   iff j <= i: a square causal block with its diagonal          -> DIAGONAL
    src >  me   iff j <  i: causal without the diagonal; query row 0 sees nothing and key
                column n-1 is seen by no one, so drop both and the rest is a square causal
                block                                                        q[1:] vs k[:-1]

Per-rank work differs by at most n pairs per step (n(n+1)/2 vs n(n-1)/2): near-balanced, the
speedup bound is close to P. Non-causal: FULL everywhere.

Communication (ring_loop.py): forward rotates K/V (kv heads only) P-1 hops towards me+1, posted
before the current block's compute; backward rotates K/V towards me-1 with fp32 dK/dV
accumulators travelling with their block (P-1 hops) so that each arrives home.

Constraints: any local length n >= 1 (with n = 1 a block from a higher rank has nothing
visible); the layout needs N divisible by P; GQA native.

Bytes sent per rank, one forward + backward, S_kv = elements of the local k (= of v), e = its
element size, e_acc = 4 (the same schedule as ring):

    S_kv * (P - 1) * (4*e + 2*e_acc)         (fp32: 48 * S_kv * (P - 1))

Packed documents (cu_seqlens): a document [a, b) is a contiguous local range on every rank (slots
ceil((a-r)/P) ..), so the masked plan (mask_plan.py) cuts each block into per-document causal bands, the
higher-rank ones shifted by one exactly as above. Every document of >= P tokens is spread over all
ranks: the best balance for mixed lengths, but every block is needed (the general bytes).
"""
from __future__ import annotations

from .mask_plan import DIAGONAL, FULL, SKIP, Band
from .ring_loop import RingFamily


class StripedAttention(RingFamily):
    name = "striped"
    layout_name = "striped"

    @staticmethod
    def blocks(me, src, p, causal, n):
        if not causal:
            return FULL
        if src <= me:
            return DIAGONAL
        if n < 2:
            return SKIP
        return [Band(slice(1, None), slice(None, -1), None, 0)]
