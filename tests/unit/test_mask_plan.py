"""The plan of a mask per layout (strategies/mask_plan.py), without processes: every band of every
(position, source) rendered equals the mask's predicate on global positions (masks.Mask.visible); the
hand-derived ring / zigzag / striped blocks (and Ulysses' one block) equal the general plan; the
transport the ring loop picks is the plan's explicit property; a strategy builds a mask's plan once."""
from __future__ import annotations

import itertools

import pytest
import torch

from ds_seqpar.masks import Mask
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies import STRATEGIES
from ds_seqpar.sharding.batch_masks import KEEP, MaskPlans
from ds_seqpar.strategies.mask_plan import masked_plan, plain_blocks, plan_mask


def render(plan, me, src):
    """How many bands compute each (query, key) pair of my block x src's block."""
    n = plan.n
    cover = torch.zeros(n, n, dtype=torch.int64)
    for b in plan.bands(me, src):
        rows, keys = range(*b.q.indices(n)), range(*b.k.indices(n))
        d = torch.arange(len(keys))[None, :] - torch.arange(len(rows))[:, None]     # j - i inside the band
        ok = torch.ones(len(rows), len(keys), dtype=torch.bool)
        if b.lo is not None:
            ok &= d >= b.lo
        if b.hi is not None:
            ok &= d <= b.hi
        assert ok.any(1).all(), f"{b}: a row of the band sees no key"
        cover[rows.start:rows.stop, keys.start:keys.stop] += ok.to(torch.int64)
    return cover


def predicate(mask, layout, padded, me, src):
    g = [layout.indices(padded, r) for r in (me, src)]
    return mask.visible(g[0], g[1], padded).to(torch.int64)


LAYOUTS = [("contiguous", 4), ("zigzag", 4), ("striped", 4), ("zigzag", 2), ("contiguous", 1), ("striped", 3)]
MASKS = [Mask(True), Mask(False), Mask(True, 5), Mask(False, 7), Mask(True, None, (5, 13, 6)),
         Mask(False, 4, (10, 14)), Mask(True, None, None, 21), Mask(False, None, None, 21), Mask(True, 9, (3, 19))]
# bidirectional blocks (Gemma 3's images): alone, longer than the window, inside documents, up to end padding
MASKS += [Mask(True, blocks=((3, 9), (14, 20))), Mask(True, 4, blocks=((2, 11), (11, 13))),
          Mask(True, None, (5, 13, 6), blocks=((1, 4), (6, 15), (19, 23))),
          Mask(True, 5, (10, 14), blocks=((2, 9), (12, 22))),
          Mask(True, None, None, 21, blocks=((15, 21),))]


@pytest.mark.parametrize("name,p", LAYOUTS)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_every_band_is_the_mask_on_global_positions(name, p, mask):
    layout = make_layout(name, p)
    padded = -(-24 // layout.required_multiple) * layout.required_multiple
    fast = STRATEGIES[{"contiguous": "ring", "zigzag": "zigzag", "striped": "striped"}[name]].blocks
    for plan in (plan_mask(mask, layout, padded, fast), masked_plan(mask, layout, padded)):
        for me, src in itertools.product(range(p), repeat=2):
            want, got = predicate(mask, layout, padded, me, src), render(plan, me, src)
            if plan.kernel_blocks:          # a plain causal plan lets pad queries compute (nobody reads them)
                real = layout.indices(padded, me) < mask.real(padded)
                want, got = want[real], got[real]
            assert torch.equal(got, want), (name, p, mask, me, src, plan.bands(me, src))
            if plan.kernel_blocks:
                continue
            assert plan.pairs(me, src) == int(want.sum())
            assert plan.needs(me, src) == bool(want.any())
            if plan.needs(me, src):
                a, b = plan.key_range(me, src)
                assert want[:, :a].sum() == 0 and want[:, b:].sum() == 0 and want[:, a].any() and want[:, b - 1].any()


@pytest.mark.parametrize("strategy", ["ring", "zigzag", "striped"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("p", [2, 4])
def test_hand_derived_blocks_equal_the_general_plan(strategy, causal, p):
    """The fast paths (ring.py, zigzag.py, striped.py) against the plan from the predicates."""
    layout = make_layout(STRATEGIES[strategy].layout_name, p)
    fast = plan_mask(Mask(causal), layout, 8 * p, STRATEGIES[strategy].blocks)
    general = masked_plan(Mask(causal), layout, 8 * p)
    assert fast.kernel_blocks and not fast.direct and general.direct and not general.kernel_blocks
    for me, src in itertools.product(range(p), repeat=2):
        assert torch.equal(render(fast, me, src), render(general, me, src)), (strategy, causal, me, src)
        assert all(b.causal or (b.lo, b.hi) == (None, None) for b in fast.bands(me, src)), fast.bands(me, src)


@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_one_block_equals_the_general_plan(causal):
    whole = make_layout("contiguous", 1)
    assert torch.equal(render(plan_mask(Mask(causal), whole, 12, plain_blocks), 0, 0),
                       render(masked_plan(Mask(causal), whole, 12), 0, 0))


def test_direct_plan_counts_received_keys_from_the_part_that_travelled():
    """A window on the contiguous ring: position 1 needs the last w - 1 keys of position 0, which is
    what travels (transport.DirectKV), so its bands index that part."""
    plan = plan_mask(Mask(True, 4), make_layout("contiguous", 2), 16, STRATEGIES["ring"].blocks)
    assert plan.direct and plan.key_range(1, 0) == (5, 8) and plan.key_range(0, 1) is None
    [band] = plan.bands(1, 0)
    [got] = plan.received(1, 0)
    assert (got.k.start, got.k.stop) == (band.k.start - 5, band.k.stop - 5) and got.q == band.q
    assert plan.received(1, 1) == plan.bands(1, 1)


def test_plan_cache_builds_each_mask_once():
    built = []

    def build(mask, padded):
        built.append((mask, padded))
        return object()
    cache = MaskPlans()                                         # the mask seam's plans (sharding/batch_masks.py)
    docs = Mask.from_boundaries([0, 5, 16])
    first = cache.get(docs, 16, build)
    for _ in range(5):                                          # the other layers of the model
        assert cache.get(Mask.from_boundaries([0, 5, 16]), 16, build) is first
    cache.get(docs.with_options(True, 3), 16, build)            # a sliding layer: its own plan
    cache.get(docs, 32, build)
    assert len(built) == 3
    for i in range(KEEP):                                       # later batches push the first one out
        cache.get(Mask(True, None, None, i + 1), 16, build)
    cache.get(docs, 16, build)
    assert len(built) == 3 + KEEP + 1
