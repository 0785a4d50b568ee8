"""Packed-document arithmetic without processes: boundaries, segments per layout, and the sub-block
decomposition, which must tile exactly the (same document, causal) mask of every block."""
import itertools

import pytest
import torch

from ds_seqpar.sharding.documents import (Documents, as_boundaries, boundaries_from_positions, check_documents,
                                          layout_stride, positions_from_boundaries)
from ds_seqpar.kernels.bands import cut_band
from ds_seqpar.masks import Mask
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies.mask_plan import masked_plan

LAYOUTS = [("contiguous", 4, 1), ("zigzag", 4, 1), ("striped", 4, 1), ("zigzag", 2, 2), ("striped", 2, 2),
           ("contiguous", 1, 1), ("zigzag", 3, 1)]
BOUNDS = [[0, 48], [0, 1, 2, 3, 48], [0, 5, 6, 17, 29, 30, 45], [0, 7, 16, 45, 47], [0, 12, 24, 36, 48]]


def _mask(docs, g_q, g_k, causal):
    dq, dk = docs.doc_of(g_q), docs.doc_of(g_k)
    same = (dq[:, None] == dk[None, :]) & (dq[:, None] >= 0)
    return same & (g_k[None, :] <= g_q[:, None]) if causal else same


def _plan(docs, ring_layout, causal):
    return masked_plan(Mask.from_boundaries(docs.bounds, causal), ring_layout, docs.padded_len)


def _pieces(plan, me, src, tile=None):
    """The plan's bands of (me, src) cut into sub-blocks (causal squares in tiles of ``tile``), local slots."""
    shift = lambda s, a: slice(a + s.start, a + s.stop)  # noqa: E731
    return [s._replace(q=shift(s.q, b.q.start), k=shift(s.k, b.k.start)) for b in plan.bands(me, src)
            for s in cut_band(b.q.stop - b.q.start, b.k.stop - b.k.start, b.lo, b.hi, tile)]


def _tiled(subs, nq, nk):
    """How many sub-blocks cover each (query, key) pair (causal sub-blocks: their lower triangle)."""
    cover = torch.zeros(nq, nk, dtype=torch.int64)
    for sub in subs:
        rows, cols = sub.q.stop - sub.q.start, sub.k.stop - sub.k.start
        block = torch.ones(rows, cols, dtype=torch.int64)
        if sub.causal:
            assert rows == cols, f"causal sub-block must be square: {sub}"
            block = block.tril()
        cover[sub.q, sub.k] += block
    return cover


@pytest.mark.parametrize("name,ring,ulysses", LAYOUTS)
@pytest.mark.parametrize("bounds", BOUNDS)
@pytest.mark.parametrize("causal,tile", [(True, None), (False, None), (True, 3)])
def test_sub_blocks_tile_the_document_mask_exactly(name, ring, ulysses, bounds, causal, tile):
    """Also with causal squares cut into tiles of 3 (kernels' causal_tile)."""
    layout = make_layout(name, ring, ulysses)
    padded = -(-48 // layout.required_multiple) * layout.required_multiple
    docs = Documents(bounds, padded)
    plan = _plan(docs, layout.ring_layout, causal)
    idx = [layout.ring_layout.indices(padded, r) for r in range(ring)]
    for me, src in itertools.product(range(ring), repeat=2):
        subs = _pieces(plan, me, src, None if tile is None else lambda size: tile)
        cover = _tiled(subs, len(idx[me]), len(idx[src]))
        want = _mask(docs, idx[me], idx[src], causal).to(torch.int64)
        assert torch.equal(cover, want), (name, ring, ulysses, bounds, causal, me, src, subs)
        assert plan.needs(me, src) == bool(want.any())


def test_cpu_kernel_cuts_small_causal_squares_only():
    from ds_seqpar.kernels import TorchKernel
    kernel = TorchKernel()
    assert [kernel.causal_tile(n, "cpu") for n in (64, 256, 512, 1024, 4096)] == [None, None, 128, 128, 256]
    subs = _pieces(_plan(Documents([0, 300], 300), make_layout("contiguous", 1), True), 0, 0,
                   lambda size: kernel.causal_tile(size, "cpu"))
    assert [(s.q.start, s.q.stop, s.k.start, s.k.stop, s.causal) for s in subs] == [
        (0, 128, 0, 128, True), (128, 256, 128, 256, True), (128, 256, 0, 128, False),
        (256, 300, 256, 300, True), (256, 300, 0, 256, False)]


def test_whole_sequence_policy_is_one_square_per_document():
    docs = Documents([0, 3, 10, 11], 12)                   # token 11: end padding, attends nothing
    subs = _pieces(_plan(docs, make_layout("contiguous", 1), True), 0, 0)
    assert [(s.q.start, s.q.stop, s.causal) for s in subs] == [(0, 3, True), (3, 10, True), (10, 11, True)]
    assert [(s.k.start, s.k.stop) for s in subs] == [(0, 3), (3, 10), (10, 11)]


def test_segments_follow_documents_and_runs():
    docs = Documents([0, 5, 16], 16)
    zig = make_layout("zigzag", 2)                          # rank 0: tokens 0-3, 12-15
    g = zig.indices(16, 0)
    segs = docs.segments(g, layout_stride([zig.indices(16, r) for r in range(2)]))
    assert [(s.start, s.length, s.doc, s.first) for s in segs] == [(0, 4, 0, 0), (4, 4, 1, 12)]
    stri = make_layout("striped", 4)                        # rank 1: tokens 1, 5, 9, 13
    segs = docs.segments(stri.indices(16, 1), 4)
    assert [(s.start, s.length, s.doc, s.first, s.stride) for s in segs] == [(0, 1, 0, 1, 4), (1, 3, 1, 5, 4)]


def test_boundaries_and_positions_round_trip():
    pos = torch.tensor([0, 1, 2, 0, 0, 1])
    assert boundaries_from_positions(pos) == (0, 3, 4, 6)
    assert positions_from_boundaries((0, 3, 4, 6)).tolist() == pos.tolist()
    assert as_boundaries(torch.tensor([0, 4], dtype=torch.int32)) == (0, 4)


@pytest.mark.parametrize("bounds,batch,needle", [
    ([2, 8], 1, "must start at 0"), ([0, 4, 4, 8], 1, "strictly increasing"), ([0, 8], 2, "batch size 1"),
    ([0, 3], 1, "must end at the real sequence length"), ([0], 1, "at least two entries"),
])
def test_check_documents_names_cu_seqlens(bounds, batch, needle):
    with pytest.raises(ValueError, match="cu_seqlens") as err:
        check_documents(bounds, batch, 8, 4)
    assert needle in str(err.value)


@pytest.mark.parametrize("bad", [torch.tensor([[0, 4]]), torch.tensor([0.0, 4.0]), [0, True], "04"])
def test_cu_seqlens_must_be_integers(bad):
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D integer"):
        as_boundaries(bad)
