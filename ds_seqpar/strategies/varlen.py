"""The masked plan in the form bench/ and plan/kernel_model.py read it: ``policy(me, src, P, causal, n)``
-> the kernel sub-blocks of (me's queries) x (src's keys), with ``pairs`` and ``needs``. It is
mask_plan.masked_plan with each band cut as a kernel with these preferences cuts it (``tile``: the
torch kernel's causal_tile, ``column``: its band_column; kernels/bands.py: cut_band), so the tools
count and time exactly the calls the ring loop makes; the runtime itself runs the plan's bands.
"""
from __future__ import annotations

from typing import Callable, List, Optional


from ..kernels.bands import SubBlock, cut_band
from ..masks import Mask
from ..sharding.documents import Documents
from ..sharding.layouts import make_layout
from .mask_plan import MaskPlan, masked_plan

TileFn = Optional[Callable[[int], Optional[int]]]


class CutPlan:
    """A masked plan whose bands are cut into kernel sub-blocks (module doc)."""

    def __init__(self, plan: MaskPlan, tile: TileFn, column: TileFn):
        self.plan, self.tile, self.column = plan, tile, column

    def __call__(self, me: int, src: int, p: int, causal: bool, n: int) -> List[SubBlock]:
        subs = []
        for b in self.plan.bands(me, src):
            qa, ka = b.q.start, b.k.start
            for s in cut_band(b.q.stop - qa, b.k.stop - ka, b.lo, b.hi, self.tile, self.column):
                subs.append(s._replace(q=slice(qa + s.q.start, qa + s.q.stop), k=slice(ka + s.k.start, ka + s.k.stop)))
        return subs

    def key_range(self, me: int, src: int):
        return self.plan.key_range(me, src)

    def needs(self, me: int, src: int) -> bool:
        return self.plan.needs(me, src)

    def pairs(self, me: int, src: int) -> int:
        return self.plan.pairs(me, src)


def document_blocks(docs: Documents, ring_layout, causal: bool, tile: TileFn = None,
                    window: Optional[int] = None, column: TileFn = None) -> CutPlan:
    """The masked plan over the ring positions of ``ring_layout`` for docs.padded_len tokens."""
    mask = Mask.from_boundaries(docs.bounds, causal, window)
    return CutPlan(masked_plan(mask, ring_layout, docs.padded_len), tile, column)


def whole_sequence_blocks(docs: Documents, causal: bool, tile: TileFn = None,
                          window: Optional[int] = None, column: TileFn = None) -> CutPlan:
    """The masked plan of one process holding the whole sequence in global order (Ulysses)."""
    return document_blocks(docs, make_layout("contiguous", 1), causal, tile, window, column)


def one_document(padded_len: int, seq_len: Optional[int]) -> Documents:
    """A sequence without cu_seqlens as the masked plan sees it: one document of the real tokens."""
    return Documents((0, seq_len or padded_len), padded_len)


__all__ = ["CutPlan", "document_blocks", "one_document", "whole_sequence_blocks"]
