"""Band decomposition (kernels/bands.py): rendered, the pieces cover every visible (query, key)
pair exactly once and no hidden pair, for any band, block shape and tile."""
import itertools
import random

import torch

from ds_seqpar.kernels.bands import band_blocks, visible_pairs

from ..reference import band_visible


def render(subs, nq, nk, qa=0, ka=0, tall=False):
    """How many times each (i, j) of the block is computed (``tall``: causal / anti blocks may be
    non-square, as band_columns cuts them)."""
    count = torch.zeros(nq, nk, dtype=torch.int64)
    for s in subs:
        rows, cols = range(s.q.start - qa, s.q.stop - qa), range(s.k.start - ka, s.k.stop - ka)
        assert rows.start >= 0 and rows.stop <= nq and cols.start >= 0 and cols.stop <= nk, s
        if s.causal or s.anti:
            assert len(rows) == len(cols) or (tall and len(rows) > len(cols)), f"{s}: square, or tall if allowed"
        shift = len(rows) - len(cols)             # anti blocks align bottom-right (band_columns)
        for a, i in enumerate(rows):
            for b, j in enumerate(cols):
                if (s.causal and b > a) or (s.anti and b < a - shift):
                    continue
                count[i, j] += 1
    return count


def predicate(nq, nk, lo, hi):
    return band_visible(nq, nk, lo, hi).to(torch.int64)


def check(nq, nk, lo, hi, tile, qa=0, ka=0, column=None):
    subs = band_blocks(qa, nq, ka, nk, lo, hi, tile, column)
    want = predicate(nq, nk, lo, hi)
    got = render(subs, nq, nk, qa, ka, tall=column is not None)
    assert torch.equal(got, want), f"nq={nq} nk={nk} lo={lo} hi={hi} tile={tile} column={column}:\n{got}\nwant\n{want}"
    assert sum(visible_pairs(s) for s in subs) == int(want.sum())
    return subs


def test_every_small_band_is_covered_exactly_once():
    bounds = [None, -9, -5, -3, -1, 0, 1, 2, 4, 8]
    for nq, nk in ((1, 1), (5, 5), (6, 4), (3, 9)):
        for lo, hi in itertools.product(bounds, bounds):
            for tile in (None, 1, 2, 3):
                check(nq, nk, lo, hi, tile, qa=2, ka=3)


def test_random_bands_on_larger_blocks():
    rng = random.Random(0)
    for _ in range(150):
        nq, nk = rng.randint(1, 40), rng.randint(1, 40)
        lo = rng.choice([None, rng.randint(-45, 10)])
        hi = rng.choice([None, rng.randint(-10, 45)])
        check(nq, nk, lo, hi, rng.choice([None, 1, 4, 7, 16]))


def test_sliding_window_is_full_rectangles_plus_edges():
    # window 8 on a 32-token causal block, tile 4: per row tile one anti square, one causal square,
    # and full rectangles between; nothing outside the band is computed
    subs = band_blocks(0, 32, 0, 32, -7, 0, 4)
    assert any(s.anti for s in subs) and any(s.causal for s in subs)
    assert sum(visible_pairs(s) for s in subs) == int(predicate(32, 32, -7, 0).sum())


def test_key_columns_cover_every_band_exactly_once():
    """band_columns: every band, block shape and column width (clipped triangles fall back to the row
    cut), on small blocks exhaustively and larger ones at random."""
    bounds = [None, -9, -5, -3, -1, 0, 1, 2, 4, 8]
    for nq, nk in ((1, 1), (5, 5), (6, 4), (3, 9), (12, 12)):
        for lo, hi in itertools.product(bounds, bounds):
            for column in (1, 2, 3, 16):
                check(nq, nk, lo, hi, 2, qa=2, ka=3, column=column)
    rng = random.Random(1)
    for _ in range(150):
        nq, nk = rng.randint(1, 60), rng.randint(1, 60)
        lo = rng.randint(-50, 10)
        hi = rng.choice([None, rng.randint(lo, 50)])
        check(nq, nk, lo, hi, rng.choice([None, 2, 5]), column=rng.choice([1, 3, 8, 20]))


def test_a_window_is_a_tall_block_and_an_anti_square_per_key_column():
    # window 32 over 128 tokens, columns of 8: inside the block every key tile is one top-left causal
    # block of 31 rows and one 8 x 8 anti square; the block end shortens the last tall blocks and
    # clips the last tiles' anti squares (those fall back to the row cut)
    subs = check(128, 128, -31, 0, 4, column=8)
    tall = [s for s in subs if s.causal and (s.q.stop - s.q.start, s.k.stop - s.k.start) == (31, 8)]
    anti = [s for s in subs if s.anti and (s.q.stop - s.q.start, s.k.stop - s.k.start) == (8, 8)]
    assert len(tall) == 13 and len(anti) == 12 and len(subs) == 13 + 12 + 5
    assert all(s.k.stop - s.k.start <= 8 for s in subs)
