"""The mask policy of packed documents: which sub-blocks of (my queries) x (src's keys) to compute
when attention stays inside documents (cu_seqlens), for every ring layout and for Ulysses.

Notation as in ring_loop.py (me, src, P, n local tokens) and sharding/documents.py (segments: runs
of a local order inside one document, advancing by the layout's stride s in global order).

Decomposition. Only segments of the same document interact. For a query segment Q (local slots
[qa, qa+nq), global positions gq0 + s*i) and a key segment K of the same document (local slots
[ka, ka+nk), global gk0 + s*j), key j is visible to query i under the causal mask iff
gk0 + s*j <= gq0 + s*i, i.e. iff  j + o <= i  with the integer offset o = ceil((gk0 - gq0) / s).
In "virtual" coordinates (query i at i, key j at o + j) the mask is kv <= qv, so Q x K is

    keys with o + j <  0              seen by every query          -> FULL   rectangle
    keys with o + j in [m, e)         m = max(o, 0), e = min(o + nk, nq):
                                      queries [m, e) x those keys  -> a square causal block
                                      queries [e, nq) x those keys -> FULL   rectangle
    keys with o + j >= nq             seen by no query             -> nothing

exactly the kernels' two shapes (full rectangles and top-left causal squares): no mask tensor, no
new kernel. A kernel that wastes work on small causal blocks (the CPU flash kernel skips masked
keys only in tiles of 512) gets its causal squares cut further: tile-sized causal squares on the
diagonal plus, per row of tiles, one full rectangle of the keys before it (kernels: causal_tile).
One masked block instead (the CPU kernel's attn_mask) measured 3.7x slower than per-document
sub-blocks for two documents in a 4096-token block and 8x for eight (reports/packed_cpu.md).

Non-causal: Q x K is one FULL rectangle. Pads (PAD_DOC) pair with nothing: a pad row sees no key
in any block and keeps lse = -inf (merge.py), and no real row sees a pad key.
Contiguous, zigzag and striped diagonals come out as before (one causal square per document
piece; striped blocks from a higher rank: o = 1, queries [1, ..) x keys [.., -1)).

Work is proportional to the documents: a block where no query and key share a document is SKIP,
so causal work is the sum of squared document lengths (over 2), not N^2 / 2.

``needs(me, src)`` (a non-empty policy) is what the direct K/V exchange of ring_loop.py uses to send
a block only to the ranks that compute on it; every rank derives it from the same global
cu_seqlens, so all ranks agree on the schedule without a word exchanged.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..sharding.documents import PAD_DOC, Documents, Segment, layout_stride
from .ring_loop import SubBlock

TileFn = Optional[Callable[[int], Optional[int]]]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def causal_square(qa: int, ka: int, size: int, tile: Optional[int]) -> List[SubBlock]:
    """The causal square q [qa, qa+size) x k [ka, ka+size), whole, or cut into ``tile``-sized causal
    squares on the diagonal and, for each row of tiles, one full rectangle of the keys before it."""
    if tile is None or size <= tile:
        return [SubBlock(slice(qa, qa + size), slice(ka, ka + size), True)]
    subs = []
    for a in range(0, size, tile):
        b = min(a + tile, size)
        subs.append(SubBlock(slice(qa + a, qa + b), slice(ka + a, ka + b), True))
        if a:
            subs.append(SubBlock(slice(qa + a, qa + b), slice(ka, ka + a), False))
    return subs


def pair_blocks(qs: Segment, ks: Segment, causal: bool, tile: TileFn = None) -> List[SubBlock]:
    """Sub-blocks of query segment ``qs`` x key segment ``ks`` (same document), see the module doc;
    ``tile(size)`` may cut a causal square into smaller pieces (kernels/base.py: causal_tile)."""
    qa, nq, ka, nk = qs.start, qs.length, ks.start, ks.length
    if not causal:
        return [SubBlock(slice(qa, qa + nq), slice(ka, ka + nk), False)]
    o = _ceil_div(ks.first - qs.first, qs.stride)         # key j sits at virtual o + j
    subs = []
    before = min(max(-o, 0), nk)                          # keys with o + j < 0: seen by all queries
    if before:
        subs.append(SubBlock(slice(qa, qa + nq), slice(ka, ka + before), False))
    m, e = max(o, 0), min(o + nk, nq)
    if e > m:
        keys = slice(ka + m - o, ka + e - o)
        subs.extend(causal_square(qa + m, keys.start, e - m, tile(e - m) if tile is not None else None))
        if e < nq:
            subs.append(SubBlock(slice(qa + e, qa + nq), keys, False))
    return subs


def _by_doc(segments: Sequence[Segment]) -> Dict[int, List[Segment]]:
    out: Dict[int, List[Segment]] = defaultdict(list)
    for seg in segments:
        if seg.doc != PAD_DOC:
            out[seg.doc].append(seg)
    return out


class DocumentBlocks:
    """A mask policy ``blocks(me, src, p, causal, n)`` for packed documents over ``P`` positions whose
    local orders have global positions ``local_indices[r]`` (each of n tokens). Built once per
    attention call; sub-blocks of every (me, src) pair are computed on first use and kept."""

    def __init__(self, docs: Documents, local_indices: Sequence[torch.Tensor], causal: bool, tile: TileFn = None):
        stride = layout_stride(local_indices)
        self.docs, self.causal, self.p, self.tile = docs, causal, len(local_indices), tile
        self.n = int(local_indices[0].numel())
        self._segs = [_by_doc(docs.segments(g, stride)) for g in local_indices]
        self._cache: Dict[Tuple[int, int], List[SubBlock]] = {}

    def __call__(self, me: int, src: int, p: int, causal: bool, n: int) -> List[SubBlock]:
        if (me, src) not in self._cache:
            mine, theirs = self._segs[me], self._segs[src]
            subs = []
            for doc in sorted(mine.keys() & theirs.keys()):
                for qs in mine[doc]:
                    for ks in theirs[doc]:
                        subs.extend(pair_blocks(qs, ks, self.causal, self.tile))
            self._cache[me, src] = subs
        return self._cache[me, src]

    def needs(self, me: int, src: int) -> bool:
        """Does position ``me`` compute anything on ``src``'s K/V block?"""
        return bool(self(me, src, self.p, self.causal, self.n))

    def pairs(self, me: int, src: int) -> int:
        """(q, k) pairs computed by ``me`` on ``src``'s block (the work the kernels do)."""
        return sum(_pairs(s) for s in self(me, src, self.p, self.causal, self.n))


def _pairs(sub: SubBlock) -> int:
    nq, nk = sub.q.stop - sub.q.start, sub.k.stop - sub.k.start
    return nq * (nq + 1) // 2 if sub.causal else nq * nk


def document_blocks(docs: Documents, ring_layout, causal: bool, tile: TileFn = None) -> DocumentBlocks:
    """The policy over the ring positions of ``ring_layout`` for a sequence of docs.padded_len tokens."""
    n = docs.padded_len
    return DocumentBlocks(docs, [ring_layout.indices(n, r) for r in range(ring_layout.size)], causal, tile)


def whole_sequence_blocks(docs: Documents, causal: bool, tile: TileFn = None) -> DocumentBlocks:
    """The policy of one process holding the whole sequence in global order (Ulysses after its
    all-to-all): a single position."""
    return DocumentBlocks(docs, [torch.arange(docs.padded_len)], causal, tile)


__all__ = ["pair_blocks", "DocumentBlocks", "document_blocks", "whole_sequence_blocks"]
