"""Ring attention on the contiguous layout: rank r holds tokens [r*n, (r+1)*n).

Notation: P ring ranks, n = N / P local tokens, me = this rank's ring position, src = owner of
the K/V block held at a ring step (see ring_loop.py for the loop and its legend).

Math -> code. Query block me against key block src is, under the causal mask,

    src == me   the square diagonal block: query i sees keys j <= i        -> DIAGONAL
    src <  me   every key precedes every query                             -> FULL
    src >  me   every key follows every query: nothing to compute          -> SKIP

and non-causal attention is FULL for every block. Each rank merges its blocks' (out, lse) in fp32.
The work is imbalanced under causal masking: rank r computes r full blocks plus half a block,
so the slowest rank does P - 1/2 blocks of the P^2/2 total, and the speedup over one process is
bounded by P^2 / (2P - 1) (1.33 at P = 2). zigzag and striped fix that with other layouts.

Communication (ring_loop.py): forward rotates K/V (kv heads only) P-1 hops towards me+1, each
posted before the current block's compute; backward rotates K/V again towards me-1, and fp32
dK/dV accumulators travel with their block (P-1 hops) so that each arrives home.
Skipped blocks are still relayed: every block visits every rank.

Constraints: any local length n >= 1 (the layout needs N divisible by P); GQA native.

Bytes sent per rank, one forward + backward, S_kv = elements of the local k (= of v), e = its
element size, e_acc = 4:

    S_kv * (P - 1) * (4*e + 2*e_acc)         (fp32: 48 * S_kv * (P - 1))

Packed documents (cu_seqlens): the masked plan (mask_plan.py) on this layout; a document is a
contiguous run of one or a few neighbouring ranks, so a block is needed only by the later ranks its
last document reaches, and K/V travel only there (transport.DirectKV): documents that stay inside
their shards send nothing at all. Balance follows where the long documents fall.
"""
from __future__ import annotations

from .mask_plan import DIAGONAL, FULL, SKIP
from .ring_loop import RingFamily


class RingAttention(RingFamily):
    name = "ring"
    layout_name = "contiguous"

    @staticmethod
    def blocks(me, src, p, causal, n):
        if not causal or src < me:
            return FULL
        return DIAGONAL if src == me else SKIP
