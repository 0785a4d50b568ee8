"""Diagonal bands of a (queries x keys) block, cut into the three shapes the kernels compute.

Every mask ds_seqpar applies inside one pair of token runs is a band of diagonals: with queries
at local rows i and keys at local columns j of runs that advance by the same global stride,

    causal            key j visible to query i  iff  j - i <= hi
    sliding window    lo <= j - i               (the window's far edge)
    both              lo <= j - i <= hi

(strategies/mask_plan.py derives lo and hi from global positions; None means unbounded; a ``Band``
names one). ``AttentionKernel.band`` (base.py) computes a band; its default cuts it here into the three
shapes every kernel computes:

    FULL rectangle        every (i, j) of the slices
    CAUSAL square         j <= i (top-left aligned; what every kernel offers)
    ANTI-causal square    j >= i (the window's far edge; kernels/base.py runs it as a causal
                          square on the reversed sequence)

Legend: rows [R0, R1) and keys [C0, C1) are block-local; ``qa`` / ``ka`` offset them into the
tensors the ring loop holds.

Upper edge only (j <= i + h): rows below C0 - h see nothing; row i in [ra, rb) sees keys
[C0, i + h], i.e. a full rectangle of keys [C0, ra + h) and a causal square of keys
[ra + h, rb + h); rows from rb = C1 - h on see every key.
Lower edge only (j >= i + l): the mirror: rows before C0 - l see every key; row i in [ra, rb)
sees [i + l, C1): an anti-causal square of keys [ra + l, rb + l) and a full rectangle after it;
rows from C1 - l on see nothing.
Both edges: rows in tiles of t <= hi - lo; each tile [a, b) needs keys [a + lo, b - 1 + hi], which
split into a lower-edge part [a + lo, b + lo), a full middle [b + lo, a + hi) and an upper-edge
part [a + hi, b + hi), each with one edge only (t <= hi - lo keeps the parts disjoint).

Key columns (a kernel that computes tall causal blocks: torch_kernel.py's CPU path). Cut by
rows, a window of w costs two t x t triangles per t rows, each a whole square to a kernel that skips
masked work only in big key tiles: small squares cost twice their pairs. Cut by key tiles of c
columns instead, each tile's visible rows [c0 - hi, c1 - lo) are one tall top-left causal block (its
upper triangle, then the rows that see the whole tile) and the c x c anti square of its lower triangle:
the wasted triangle halves are small against w, and the anti square, which kernels run reversed, is
only c rows (c <= hi - lo + 1 keeps the tall block above the far edge). Where the block boundary clips
a triangle, that piece falls back to the row cut; without an upper edge the tall block is a full one.

Every visible pair is computed exactly once and no hidden pair at all (tests/unit/test_bands.py
renders the pieces and compares with the predicate).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch


class Band(NamedTuple):
    """Queries q_bshd[:, q] against keys kv[:, k], key j (of the slice) visible to query i iff
    lo <= j - i <= hi (None: unbounded). Causal on a square is (None, 0), every pair (None, None).
    A plan's bands are ``trimmed``: every row sees at least one key and every key is seen."""

    q: slice
    k: slice
    lo: Optional[int] = None
    hi: Optional[int] = None

    @property
    def causal(self) -> bool:
        """Query i sees keys j <= i (and no lower edge): a kernel's causal block when square."""
        return self.lo is None and self.hi == 0

    @property
    def anti(self) -> bool:
        """Query i sees keys j >= i (and no upper edge): a kernel's anti-causal block when square."""
        return self.hi is None and self.lo == 0


def trimmed(qa: int, nq: int, ka: int, nk: int, lo: Optional[int], hi: Optional[int]) -> Optional[Band]:
    """The band of rows [qa, qa + nq) x keys [ka, ka + nk) cut to the rows that see a key and the keys
    some row sees, its offsets moved with the cut; None: empty."""
    if lo is not None and hi is not None and hi < lo:
        return None
    r0, r1 = max(0, -hi) if hi is not None else 0, min(nq, nk - lo) if lo is not None else nq
    if r1 <= r0:
        return None
    c0, c1 = max(0, r0 + lo) if lo is not None else 0, min(nk, r1 + hi) if hi is not None else nk
    if c1 <= c0:
        return None
    # the edges stay even where they no longer bind: a kernel's cut keys off them (a window's columns)
    lo = None if lo is None else lo - c0 + r0
    hi = None if hi is None else hi - c0 + r0
    return Band(slice(qa + r0, qa + r1), slice(ka + c0, ka + c1), lo, hi)


def band_pairs(nq: int, nk: int, lo: Optional[int], hi: Optional[int]) -> int:
    """(q, k) pairs of a band of nq rows x nk keys: per row the keys [max(0, i + lo), min(nk, i + hi + 1))."""
    i = torch.arange(nq)
    first = (i + lo).clamp(min=0) if lo is not None else torch.zeros_like(i)
    stop = (i + hi + 1).clamp(max=nk) if hi is not None else torch.full_like(i, nk)
    return int((stop - first).clamp(min=0).sum())


def cut_band(nq: int, nk: int, lo: Optional[int], hi: Optional[int], tile=None, column=None) -> List["SubBlock"]:
    """A band's pieces with a kernel's preferences: ``tile(size)`` the square size to cut causal / anti
    squares of ``size`` into, ``column(width)`` the keys per column for a band of ``width`` diagonals
    (None from either: no cut); both judged on the band's width (its square's side when it has one edge)."""
    width = None if lo is None or hi is None else hi - lo
    t = None if tile is None else tile(min(nq, nk) if width is None else max(width, 1))
    c = None if column is None or lo is None else column(min(nq, nk) if width is None else width + 1)
    return band_blocks(0, nq, 0, nk, lo, hi, t, c)


class SubBlock(NamedTuple):
    """One kernel call: queries q_bshd[:, q] against keys kv[:, k]; ``causal``: query i sees keys
    j <= i (top-left; square except from band_columns); ``anti``: its mirror, query i sees keys
    j >= i - (nq - nk) (bottom-right; j >= i on a square); neither: every pair. Tall causal / anti
    blocks (band_columns) have nq > nk, never fewer rows than keys."""

    q: slice
    k: slice
    causal: bool
    anti: bool = False


def visible_pairs(sub: SubBlock) -> int:
    """(q, k) pairs a sub-block computes."""
    nq, nk = sub.q.stop - sub.q.start, sub.k.stop - sub.k.start
    if not (sub.causal or sub.anti):
        return nq * nk
    m = min(nq, nk)                               # the triangle, then rows that see every key
    return m * (m + 1) // 2 + (nq - m) * nk


def _rect(qa, ka, r0, r1, c0, c1) -> List[SubBlock]:
    if r1 <= r0 or c1 <= c0:
        return []
    return [SubBlock(slice(qa + r0, qa + r1), slice(ka + c0, ka + c1), False)]


def causal_square(qa: int, ka: int, size: int, tile: Optional[int]) -> List[SubBlock]:
    """The causal square q [qa, qa+size) x k [ka, ka+size), whole, or cut into ``tile``-sized causal
    squares on the diagonal and, for each row of tiles, one full rectangle of the keys before it."""
    if size <= 0:
        return []
    if tile is None or size <= tile:
        return [SubBlock(slice(qa, qa + size), slice(ka, ka + size), True)]
    subs = []
    for a in range(0, size, tile):
        b = min(a + tile, size)
        subs.append(SubBlock(slice(qa + a, qa + b), slice(ka + a, ka + b), True))
        subs.extend(_rect(qa, ka, a, b, 0, a))
    return subs


def anti_square(qa: int, ka: int, size: int, tile: Optional[int]) -> List[SubBlock]:
    """The anti-causal square (query i sees keys j >= i), whole or cut like ``causal_square``
    mirrored: tile-sized anti squares on the diagonal, a full rectangle of the keys after each."""
    if size <= 0:
        return []
    if tile is None or size <= tile:
        return [SubBlock(slice(qa, qa + size), slice(ka, ka + size), False, True)]
    subs = []
    for a in range(0, size, tile):
        b = min(a + tile, size)
        subs.append(SubBlock(slice(qa + a, qa + b), slice(ka + a, ka + b), False, True))
        subs.extend(_rect(qa, ka, a, b, b, size))
    return subs


def upper_edge(qa, ka, r0, r1, c0, c1, h, tile=None) -> List[SubBlock]:
    """Rows [r0, r1) x keys [c0, c1) where key j is visible to query i iff j <= i + h."""
    if r1 <= r0 or c1 <= c0:
        return []
    ra = min(r1, max(r0, c0 - h))                 # first row that sees a key
    rb = max(ra, min(r1, c1 - h))                 # rows from here on see every key
    return (_rect(qa, ka, ra, rb, c0, ra + h)
            + causal_square(qa + ra, ka + ra + h, rb - ra, tile)
            + _rect(qa, ka, rb, r1, c0, c1))


def lower_edge(qa, ka, r0, r1, c0, c1, l, tile=None) -> List[SubBlock]:
    """Rows [r0, r1) x keys [c0, c1) where key j is visible to query i iff j >= i + l."""
    if r1 <= r0 or c1 <= c0:
        return []
    ra = min(r1, max(r0, c0 - l))                 # rows before this one see every key
    rb = max(ra, min(r1, c1 - l))                 # first row that sees no key
    return (_rect(qa, ka, r0, ra, c0, c1)
            + anti_square(qa + ra, ka + ra + l, rb - ra, tile)
            + _rect(qa, ka, ra, rb, rb + l, c1))


def band_columns(qa, nq, ka, nk, lo: int, hi: Optional[int], column: int, tile=None) -> List[SubBlock]:
    """The band lo <= j - i <= hi (lo given: a window's far edge) cut into key tiles of ``column``
    keys, a tall causal block and an anti square per tile (module doc); needs column <= hi - lo + 1."""
    subs: List[SubBlock] = []
    stop = nk if hi is None else min(nk, nq + hi)  # keys [max(0, lo), stop) are seen by some row
    for c0 in range(max(0, lo), stop, column):
        c1 = min(c0 + column, stop)
        end = c1 - lo                              # rows before this one see some key of the tile
        top = 0 if hi is None else c0 - hi         # first row that sees key c0
        split = end - (c1 - c0)                    # the lower part: the tile's anti square
        # blocks keep seq_q >= seq_k: keys past a short block's triangle are seen by none of its rows
        a, b = max(top, 0), min(split, nq)         # upper part: its far edge sees every key
        if a < b and hi is None:
            subs += _rect(qa, ka, a, b, c0, c1)
        elif a < b:
            subs += ([SubBlock(slice(qa + a, qa + b), slice(ka + c0, ka + min(c1, c0 + b - a)), True)] if a == top
                     else upper_edge(qa, ka, a, b, c0, c1, hi, tile))
        a, b = max(split, 0), min(end, nq)         # lower part: its near edge sees every key
        if a < b:
            subs += ([SubBlock(slice(qa + a, qa + b), slice(ka + max(c0, c1 - (b - a)), ka + c1), False, True)]
                     if b == end else lower_edge(qa, ka, a, b, c0, c1, lo, tile))
    return subs


def band_blocks(qa: int, nq: int, ka: int, nk: int, lo: Optional[int], hi: Optional[int],
                tile: Optional[int] = None, column: Optional[int] = None) -> List[SubBlock]:
    """Sub-blocks of rows [0, nq) x keys [0, nk) (offset by qa, ka) where key j is visible to query i
    iff lo <= j - i <= hi (None: unbounded on that side); see the module doc. ``tile`` bounds the
    size of causal / anti squares (a kernel's preference: torch_kernel.py's causal_tile); ``column``:
    cut a band with a far edge (lo given) into key tiles of that many keys instead (its band_column)."""
    if hi is not None and lo is not None and hi < lo:
        return []
    if column is not None and lo is not None:
        return band_columns(qa, nq, ka, nk, lo, hi, column if hi is None else min(column, hi - lo + 1), tile)
    if lo is None and hi is None:
        return _rect(qa, ka, 0, nq, 0, nk)
    if lo is None:
        return upper_edge(qa, ka, 0, nq, 0, nk, hi, tile)
    if hi is None:
        return lower_edge(qa, ka, 0, nq, 0, nk, lo, tile)
    r0, r1 = max(0, -hi), min(nq, nk - lo)        # rows that see at least one key
    t = max(1, hi - lo if tile is None else min(tile, hi - lo))
    subs: List[SubBlock] = []
    for a in range(r0, r1, t):
        b = min(a + t, r1)
        clip = lambda x: min(max(x, 0), nk)        # noqa: E731  (key bounds inside the block)
        subs.extend(lower_edge(qa, ka, a, b, clip(a + lo), clip(min(b + lo, a + hi)), lo, tile))
        subs.extend(_rect(qa, ka, a, b, clip(b + lo), clip(a + hi)))
        subs.extend(upper_edge(qa, ka, a, b, clip(a + hi), clip(b + hi), hi, tile))
    return subs


__all__ = ["Band", "SubBlock", "band_blocks", "band_pairs", "cut_band", "trimmed", "band_columns", "causal_square",
           "anti_square", "upper_edge", "lower_edge",
           "visible_pairs"]
