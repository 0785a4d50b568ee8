"""The plan of one mask (masks.Mask) over a layout's positions: per (me, src) the bands of
(my queries) x (src's keys) to compute, the span of src's keys they touch and their pairs. The ring
loop and Ulysses (one position holding the whole sequence) both run a plan; strategies build one per
mask, kept by the mask seam (sharding/batch_masks.py: MaskPlans), so a model's layers share the plan their
first layer built.

Notation as in ring_loop.py (me, src, P positions, n local tokens) and sharding/documents.py
(segments: runs of a local order inside one document, advancing by the layout's stride s).

Two kinds of plan:

* plain (no documents, no window, no end padding; or non-causal end padding alone): the layout's
  hand-derived ``blocks(me, src, P, causal, n)`` (ring.py, zigzag.py, striped.py; one full or causal
  block for Ulysses), with non-causal padding keeping the real keys, a prefix of every block
  (padding.py). K/V travel the relay ring. Their bands are whole kernel blocks (``kernel_blocks``):
  the loop calls them as they are, as the kernels' own tuning was measured for.
* masked (documents and / or a window, padding as no document): from the mask on global positions.
  Only segments of the same document interact. For a query segment Q (local slots [qa, qa+nq),
  global positions gq0 + s*i) and a key segment K of the same document (local slots [ka, ka+nk),
  global gk0 + s*j), with D = gk0 - gq0 every predicate is a bound on j - i:

      causal            D + s(j - i) <= 0      ->  j - i <= hi = floor(-D / s)
      window, causal    D + s(j - i) >  -w     ->  j - i >= lo = floor((-w - D) / s) + 1
      window, both ways D + s(j - i) <   w     ->  j - i <= hi = ceil((w - D) / s) - 1

      block [b0, b1)    Q's rows and K's keys inside it, D + s(j - i) > 0: a second band of them,
                        j - i >= floor(-D / s) + 1 (the causal band's far side; pairs disjoint)

  so Q x K is one band (plus one per bidirectional block holding rows and keys of both, folded into
  the rows' accumulators like any other), trimmed to the rows that see a key, and the kernel
  computes it (``kernel.band``: the default cuts it into full / causal / anti sub-blocks, the torch
  kernel with its CPU tiles and key columns, flash-attn in one call with window_size). K/V go only
  where they are computed on (``direct``; transport.py): ``key_range(me, src)`` is the span a
  position needs, derived by every rank from the same global mask, so all agree on the schedule
  without a word exchanged. Pads pair with nothing: a pad row keeps lse = -inf (merge.py).

Work is proportional to the visible pairs: causal work is the sum of squared document lengths (over
2), a window's about N * w. One masked block instead (the CPU kernel's attn_mask) measured 3.7x
slower than per-document bands for two documents in a 4096-token block and 8x for eight
(reports/packed_cpu.md).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..kernels.bands import Band, band_pairs, trimmed
from ..masks import Mask
from ..sharding.documents import PAD_DOC, Documents, Segment, layout_stride
from ..sharding.padding import valid_prefix

ALL = slice(None)
FULL = [Band(ALL, ALL)]                     # every (query, key) pair of the block
DIAGONAL = [Band(ALL, ALL, None, 0)]        # the causal square block: query i sees keys j <= i
SKIP: List[Band] = []                       # nothing in this block is visible

BlockPolicy = Callable[[int, int, int, bool, int], Sequence[Band]]


class MaskPlan:
    """Bands per (me, src) over ``positions`` positions of ``n`` tokens each, computed on first use
    and kept. ``direct``: K/V go only where they are computed on (masked plans); else the relay ring.
    ``kernel_blocks``: the bands are whole kernel blocks (plain plans), computed as they are."""

    def __init__(self, positions: int, n: int, bands: Callable[[int, int], List[Band]], direct: bool):
        self.positions, self.n, self.direct, self.kernel_blocks = positions, n, direct, not direct
        self._bands = bands
        self._cache: Dict[Tuple[int, int], List[Band]] = {}
        self._received: Dict[Tuple[int, int], List[Band]] = {}

    def bands(self, me: int, src: int) -> List[Band]:
        """The bands of my queries x src's keys, slices into the two positions' local tokens."""
        if (me, src) not in self._cache:
            self._cache[me, src] = list(self._bands(me, src))
        return self._cache[me, src]

    def key_range(self, me: int, src: int) -> Optional[Tuple[int, int]]:
        """The slots [a, b) of src's block that position ``me`` computes on; None: nothing."""
        bands = self.bands(me, src)
        if not bands:
            return None
        ks = [b.k.indices(self.n) for b in bands]
        return min(k[0] for k in ks), max(k[1] for k in ks)

    def needs(self, me: int, src: int) -> bool:
        """Does position ``me`` compute anything on src's K/V block?"""
        return self.key_range(me, src) is not None

    def pairs(self, me: int, src: int) -> int:
        """(q, k) pairs ``me`` computes on src's block (the work the kernels do)."""
        total = 0
        for b in self.bands(me, src):
            (q0, q1, _), (k0, k1, _) = b.q.indices(self.n), b.k.indices(self.n)
            total += band_pairs(q1 - q0, k1 - k0, b.lo, b.hi)
        return total

    def received(self, me: int, src: int) -> List[Band]:
        """The bands with keys counted in the part of src's block that reached ``me``: a direct plan
        sends only ``key_range(me, src)`` of another position's block (transport.DirectKV)."""
        if not self.direct or me == src:
            return self.bands(me, src)
        if (me, src) not in self._received:
            bands, a = self.bands(me, src), (self.key_range(me, src) or (0, 0))[0]
            self._received[me, src] = [b._replace(k=slice(b.k.start - a, b.k.stop - a)) for b in bands]
        return self._received[me, src]


def plan_mask(mask: Mask, ring_layout, padded: int, blocks: BlockPolicy) -> MaskPlan:
    """The plan of ``mask`` over ``ring_layout``'s positions for a sequence of ``padded`` tokens;
    ``blocks``: the layout's hand-derived bands for plain masks."""
    p, n = ring_layout.size, padded // ring_layout.size
    if mask.docs is None and mask.window is None and mask.blocks is None:
        real = mask.real(padded)
        if mask.causal or real == padded:           # causal blocks never see the end padding
            return MaskPlan(p, n, lambda me, src: blocks(me, src, p, mask.causal, n), direct=False)
        valid = valid_prefix(ring_layout, padded, real)
        return MaskPlan(p, n, lambda me, src: _real_keys(blocks(me, src, p, False, n), valid[src], n), direct=False)
    return masked_plan(mask, ring_layout, padded)


def masked_plan(mask: Mask, ring_layout, padded: int) -> MaskPlan:
    """The plan of ``mask`` from its predicates on global positions (module doc), for any mask."""
    p, n = ring_layout.size, padded // ring_layout.size
    docs = Documents(mask.bounds(padded), padded)
    local = [ring_layout.indices(padded, r) for r in range(p)]
    stride = layout_stride(local)
    segs = [_by_doc(docs.segments(g, stride)) for g in local]

    def bands(me, src):
        out = []
        for doc in sorted(segs[me].keys() & segs[src].keys()):
            for qs in segs[me][doc]:
                for ks in segs[src][doc]:
                    band = trimmed(qs.start, qs.length, ks.start, ks.length,
                                   *diagonal_bounds(qs, ks, mask.causal, mask.window))
                    if band is not None:
                        out.append(band)
                    out.extend(block_bands(qs, ks, mask.blocks or ()))
        return out
    return MaskPlan(p, n, bands, direct=True)


def block_bands(qs: Segment, ks: Segment, blocks: Sequence[Tuple[int, int]]) -> List[Band]:
    """The pairs of a causal Q x K that bidirectional blocks add (module doc): per block, its rows of
    ``qs`` against its keys of ``ks`` that come after them (gk > gq; the window bounds only earlier keys)."""
    out = []
    for start, end in blocks:
        (i0, i1), (j0, j1) = _slots(qs, start, end), _slots(ks, start, end)
        if i1 <= i0 or j1 <= j0:
            continue
        lo = (qs.first - ks.first) // qs.stride + 1 - j0 + i0      # j - i >= floor(-D / s) + 1, offsets moved
        band = trimmed(qs.start + i0, i1 - i0, ks.start + j0, j1 - j0, lo, None)
        if band is not None:
            out.append(band)
    return out


def _slots(seg: Segment, start: int, end: int) -> Tuple[int, int]:
    """The segment's slots [a, b) whose global positions first + stride * i lie in [start, end)."""
    s = seg.stride
    a, b = -((seg.first - start) // s), -((seg.first - end) // s)       # ceil((start - first) / s), likewise end
    return max(a, 0), min(b, seg.length)


def diagonal_bounds(qs: Segment, ks: Segment, causal: bool, window: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """(lo, hi): key j of ``ks`` is visible to query i of ``qs`` iff lo <= j - i <= hi (module doc);
    None is unbounded."""
    d, s = ks.first - qs.first, qs.stride
    hi = (-d) // s if causal else (None if window is None else -((d - window) // s) - 1)
    lo = None if window is None else (-window - d) // s + 1
    return lo, hi


def plain_blocks(me: int, src: int, p: int, causal: bool, n: int) -> Sequence[Band]:
    """The blocks of one position holding the whole sequence (Ulysses after its all-to-all)."""
    return DIAGONAL if causal else FULL


def _real_keys(bands: Sequence[Band], valid: int, n: int) -> List[Band]:
    """Every (non-causal) band's keys cut to the first ``valid`` of the block (padding.py)."""
    out = []
    for b in bands:
        start, stop, _ = b.k.indices(n)
        if min(stop, valid) > start:
            out.append(b._replace(k=slice(start, min(stop, valid))))
    return out


def _by_doc(segments: Sequence[Segment]) -> Dict[int, List[Segment]]:
    out: Dict[int, List[Segment]] = defaultdict(list)
    for seg in segments:
        if seg.doc != PAD_DOC:
            out[seg.doc].append(seg)
    return out


__all__ = ["ALL", "DIAGONAL", "FULL", "SKIP", "BlockPolicy", "MaskPlan", "block_bands", "diagonal_bounds",
           "masked_plan", "plain_blocks", "plan_mask"]
