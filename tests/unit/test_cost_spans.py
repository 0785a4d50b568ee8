"""The key spans a ring position sends another under a mask: the cost model and the closed forms read
them from the runtime's plan (strategies/closed_form.masked_key_ranges: MaskPlan.key_range, what
transport.DirectKV sends); tests/reference.py derives them key by key from the mask on global positions,
independently of the plan's bands. The two must agree span for span."""
import pytest

from ds_seqpar.cost import bytes as cost_bytes
from ds_seqpar.masks import Mask, check_blocks
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind, masked_key_ranges

from ..reference import ring_key_ranges

N = 240


@pytest.mark.parametrize("layout,r", [("contiguous", 4), ("zigzag", 4), ("striped", 4), ("zigzag", 2),
                                      ("contiguous", 3), ("striped", 6)])
@pytest.mark.parametrize("causal,window,docs,blocks", [
    (True, None, (100, 60, 80), None), (False, None, (100, 60, 80), None), (True, 17, None, None),
    (False, 30, None, None), (True, 9, (50, 50, 40, 100), None), (True, None, (7, 1, 150, 2, 80), None),
    (True, None, None, ((10, 40), (100, 130))), (True, 25, (120, 120), ((130, 170),)),
    (True, None, (200,), None), (False, 50, (230,), None)])          # the last two: end padding only
def test_the_plans_key_spans_are_the_key_by_key_oracles(layout, r, causal, window, docs, blocks):
    ring = make_layout(layout, r)
    blocks = check_blocks(blocks, Mask(docs=docs).bounds(N), causal) if blocks else None   # as sp.attention does
    mask = Mask(causal, window, docs, blocks=blocks)
    bounds = mask.bounds(N)
    got = masked_key_ranges(Mask.from_boundaries(bounds, causal, window, blocks=blocks), ring, N)
    want = ring_key_ranges(bounds, ring, N, causal, window, blocks)
    assert got == want, (layout, r, causal, window, docs, blocks)
    assert any(s is not None for row in want for s in row)           # a case that can fail


def test_the_cost_models_bytes_read_the_plans_spans():
    """cost/bytes.py's masked ring bytes are the closed form over the plan's spans, rank by rank."""
    sh, mask = Shapes(1, N, 4, 2, 8, 2), Mask(True, 20, (100, 60, 80))
    for strategy, size, u in [("ring", 4, 1), ("zigzag", 4, 2), ("striped", 4, 1)]:
        got = cost_bytes.rank_bytes(strategy, size, u, sh, mask)
        want = [closed_form_by_kind(strategy, size, sh, rank, u, cu_seqlens=mask.bounds(N), window=20)
                for rank in range(size)]
        assert got == want and any(g.get("ring") for g in got), strategy
