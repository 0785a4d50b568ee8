"""The masked policy: which sub-blocks of (my queries) x (src's keys) to compute when attention is
restricted by packed documents (cu_seqlens) and / or a sliding window, for every ring layout and
for Ulysses. One mask, predicates on global positions (gq query, gk key):

    same document     doc(gq) == doc(gk)                       (cu_seqlens; end padding: no document)
    causal            gk <= gq
    window w          gq - w < gk      (non-causal: |gq - gk| < w)        transformers' sliding_window

Notation as in ring_loop.py (me, src, P, n local tokens) and sharding/documents.py (segments: runs
of a local order inside one document, advancing by the layout's stride s in global order).

Decomposition. Only segments of the same document interact. For a query segment Q (local slots
[qa, qa+nq), global positions gq0 + s*i) and a key segment K of the same document (local slots
[ka, ka+nk), global gk0 + s*j), with D = gk0 - gq0 every predicate is a bound on j - i:

    causal            D + s(j - i) <= 0      ->  j - i <= hi = floor(-D / s)
    window, causal    D + s(j - i) >  -w     ->  j - i >= lo = floor((-w - D) / s) + 1
    window, both ways D + s(j - i) <   w     ->  j - i <= hi = ceil((w - D) / s) - 1

so Q x K is a band of diagonals, cut by bands.py into full rectangles, causal squares and
anti-causal squares (or, for a window and a kernel that takes tall causal blocks, into key columns of
two tall blocks each: kernels' band_column): no mask tensor, no new kernel. A kernel that wastes work on small causal
blocks (the CPU flash kernel skips masked keys only in tiles of 512) gets its squares cut further
(kernels: causal_tile). One masked block instead (the CPU kernel's attn_mask) measured 3.7x slower
than per-document sub-blocks for two documents in a 4096-token block and 8x for eight
(reports/packed_cpu.md).

Pads (PAD_DOC) pair with nothing: a pad row sees no key in any block and keeps lse = -inf
(merge.py), and no real row sees a pad key. A sequence without cu_seqlens is one document.

Work is proportional to the visible pairs: a block where no query sees a key is SKIP, so causal work
is the sum of squared document lengths (over 2), and a window's is about N * w.

``key_range(me, src)`` (the span of src's keys that me computes on, None when none) is what the direct
K/V exchange of ring_loop.py / transport.py uses to send only those keys to the ranks that compute on
them; every rank derives it from the same global mask, so all ranks agree on the schedule without a
word exchanged.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..sharding.documents import PAD_DOC, Documents, Segment, layout_stride
from .bands import SubBlock, band_blocks, visible_pairs

TileFn = Optional[Callable[[int], Optional[int]]]


def diagonal_bounds(qs: Segment, ks: Segment, causal: bool, window: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """(lo, hi): key j of ``ks`` is visible to query i of ``qs`` iff lo <= j - i <= hi (module doc);
    None is unbounded."""
    d, s = ks.first - qs.first, qs.stride
    hi = (-d) // s if causal else (None if window is None else -((d - window) // s) - 1)
    lo = None if window is None else (-window - d) // s + 1
    return lo, hi


def pair_blocks(qs: Segment, ks: Segment, causal: bool, tile: TileFn = None,
                window: Optional[int] = None, column: TileFn = None) -> List[SubBlock]:
    """Sub-blocks of query segment ``qs`` x key segment ``ks`` (same document), see the module doc;
    ``tile(size)`` may cut causal / anti squares into smaller pieces (kernels/base.py: causal_tile),
    ``column(width)`` a window's band of ``width`` diagonals into key columns (band_column)."""
    lo, hi = diagonal_bounds(qs, ks, causal, window)
    width = None if lo is None or hi is None else hi - lo
    t = None
    if tile is not None:
        t = tile(min(qs.length, ks.length) if width is None else max(width, 1))
    c = None
    if column is not None and lo is not None:
        c = column(min(qs.length, ks.length) if width is None else width + 1)
    return band_blocks(qs.start, qs.length, ks.start, ks.length, lo, hi, t, c)


def _by_doc(segments: Sequence[Segment]) -> Dict[int, List[Segment]]:
    out: Dict[int, List[Segment]] = defaultdict(list)
    for seg in segments:
        if seg.doc != PAD_DOC:
            out[seg.doc].append(seg)
    return out


class DocumentBlocks:
    """A mask policy ``blocks(me, src, p, causal, n)`` for documents (and a window) over ``P`` positions
    whose local orders have global positions ``local_indices[r]`` (each of n tokens). Built once per
    attention call; sub-blocks of every (me, src) pair are computed on first use and kept."""

    def __init__(self, docs: Documents, local_indices: Sequence[torch.Tensor], causal: bool, tile: TileFn = None,
                 window: Optional[int] = None, column: TileFn = None):
        stride = layout_stride(local_indices)
        self.docs, self.causal, self.p, self.tile, self.window = docs, causal, len(local_indices), tile, window
        self.column = column
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
                        subs.extend(pair_blocks(qs, ks, self.causal, self.tile, self.window, self.column))
            self._cache[me, src] = subs
        return self._cache[me, src]

    def key_range(self, me: int, src: int) -> Optional[Tuple[int, int]]:
        """The slots [a, b) of ``src``'s block that position ``me`` computes on; None: nothing."""
        subs = self(me, src, self.p, self.causal, self.n)
        if not subs:
            return None
        return min(s.k.start for s in subs), max(s.k.stop for s in subs)

    def needs(self, me: int, src: int) -> bool:
        """Does position ``me`` compute anything on ``src``'s K/V block?"""
        return self.key_range(me, src) is not None

    def pairs(self, me: int, src: int) -> int:
        """(q, k) pairs computed by ``me`` on ``src``'s block (the work the kernels do)."""
        return sum(visible_pairs(s) for s in self(me, src, self.p, self.causal, self.n))


def document_blocks(docs: Documents, ring_layout, causal: bool, tile: TileFn = None,
                    window: Optional[int] = None, column: TileFn = None) -> DocumentBlocks:
    """The policy over the ring positions of ``ring_layout`` for a sequence of docs.padded_len tokens."""
    n = docs.padded_len
    return DocumentBlocks(docs, [ring_layout.indices(n, r) for r in range(ring_layout.size)], causal, tile, window,
                          column)


def whole_sequence_blocks(docs: Documents, causal: bool, tile: TileFn = None,
                          window: Optional[int] = None, column: TileFn = None) -> DocumentBlocks:
    """The policy of one process holding the whole sequence in global order (Ulysses after its
    all-to-all): a single position."""
    return DocumentBlocks(docs, [torch.arange(docs.padded_len)], causal, tile, window, column)


def one_document(padded_len: int, seq_len: Optional[int]) -> Documents:
    """A sequence without cu_seqlens as the masked policy sees it: one document of the real tokens
    (end padding past ``seq_len`` belongs to none)."""
    return Documents((0, seq_len or padded_len), padded_len)


__all__ = ["pair_blocks", "diagonal_bounds", "DocumentBlocks", "document_blocks", "whole_sequence_blocks",
           "one_document"]
