"""Zigzag ring attention: the sequence in 2P chunks of c = n/2 tokens; rank r holds chunk r then
chunk 2P-1-r (an early chunk paired with a late one), so causal work is equal on every rank.

Notation: P ring ranks, n = N / P local tokens (even), local order [chunk me | chunk 2P-1-me];
src = owner of the K/V block held at a ring step, holding [chunk src | chunk 2P-1-src].

Math -> code under the causal mask (see ring_loop.py for the loop):

    src == me   both chunks in increasing global order: the whole local block is one square
                causal block                                                 -> DIAGONAL
    src <  me   chunk src precedes both my chunks; chunk 2P-1-src follows both
                -> all n queries vs the first half of the keys, full         [:, :c]
    src >  me   both of src's chunks follow my chunk me and precede my chunk 2P-1-me
                -> the second half of the queries vs all n keys, full        [c:, :]

so every off-diagonal step is exactly half a block (n*n/2 pairs) on every rank and the diagonal
is n*n/2 + c: per-rank work is equal, the speedup bound is P. Non-causal: FULL everywhere.

Communication (ring_loop.py): forward rotates K/V (kv heads only) P-1 hops towards me+1, posted
before the current block's compute; backward rotates K/V towards me-1 with fp32 dK/dV
accumulators travelling with their block (P-1 hops) so that each arrives home.

Constraints: n even when P > 1 (the global length a multiple of 2P), checked before any
communication with the lengths that would work; GQA native.

Bytes sent per rank, one forward + backward, S_kv = elements of the local k (= of v), e = its
element size, e_acc = 4 (the same schedule as ring; only the work per step differs):

    S_kv * (P - 1) * (4*e + 2*e_acc)         (fp32: 48 * S_kv * (P - 1))

Packed documents (cu_seqlens): the masked plan (mask_plan.py) on the two chunks of each rank; documents
shorter than a chunk mostly stay on one rank (nothing travels for them), a long document is
balanced as above, and only blocks that share a document with my queries are computed or sent.
"""
from __future__ import annotations

from .mask_plan import ALL, DIAGONAL, FULL, Band
from .ring_loop import RingFamily


class ZigzagAttention(RingFamily):
    name = "zigzag"
    layout_name = "zigzag"

    @staticmethod
    def blocks(me, src, p, causal, n):
        if not causal:
            return FULL
        if src == me:
            return DIAGONAL
        c = n // 2
        if src < me:
            return [Band(ALL, slice(0, c))]
        return [Band(slice(c, None), ALL)]
