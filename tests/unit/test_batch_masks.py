"""The mask seam (sp.masks, ds_seqpar/sharding/batch_masks.py) without processes: when a mask is built,
which call finds it, when the documents are checked across the ranks (the check counted, not run), and the
one size policy (KEEP entries per map, the oldest out first) on each of its three maps."""
from __future__ import annotations

import pytest
import torch

from ds_seqpar.comm import CommStats
from ds_seqpar.masks import Mask
from ds_seqpar.sharding import batch_masks
from ds_seqpar.sharding.batch_masks import KEEP, BatchMasks

N = 16
Q = torch.zeros(1, N, 1, 1)         # a shard shaped [batch, local tokens, heads, head dim]; one rank holds all


@pytest.fixture
def seam(monkeypatch):
    """A seam over one rank whose cross-rank checks are counted instead of run: (seam, checks made)."""
    checks = []
    monkeypatch.setattr(batch_masks, "check_same_on_ranks", lambda bounds, error, *a, **kw: checks.append(bounds))
    return BatchMasks(group=None, stats=CommStats(), size=1, multiple=1), checks


def test_a_mask_is_built_on_the_first_call_and_found_by_every_later_layer(seam):
    masks, checks = seam
    cu = torch.tensor([0, 5, N], dtype=torch.int32)
    masks.agreed(cu, [0, 5, N])                                   # shard_batch checked it already
    first = masks.mask(Q, True, None, cu, None)
    assert first == Mask.from_boundaries([0, 5, N]) and checks == []
    for _ in range(5):                                            # the other layers, forward and backward
        assert masks.mask(Q, True, None, cu, None) is first
    sliding = masks.mask(Q, True, None, cu, 4)
    assert sliding is not first and sliding.window == 4 and masks.mask(Q, True, None, cu, 4) is sliding
    assert checks == [], "agreed documents are never checked across the ranks again"


def test_documents_nobody_agreed_are_checked_once_then_an_in_place_write_is_new_documents(seam):
    masks, checks = seam
    cu = torch.tensor([0, 5, N])
    first = masks.mask(Q, True, None, cu, None)
    masks.mask(Q, True, None, cu, 3)                              # another layer kind: no second check
    assert checks == [(0, 5, N)]
    cu[1] = 7                                                     # written in place: new documents
    again = masks.mask(Q, True, None, cu, None)
    assert checks == [(0, 5, N), (0, 7, N)] and again.docs == (7, N - 7) and again is not first


def test_plans_are_found_by_the_masks_value_across_batches(seam):
    masks, _ = seam
    built = []

    def build(mask, padded):
        built.append((mask, padded))
        return object()
    plans = []
    for _ in range(3):                                            # three batches packed alike: new tensors
        cu = torch.tensor([0, 5, N])
        masks.agreed(cu, [0, 5, N])
        plans.append(masks.plans.get(masks.mask(Q, True, None, cu, None), N, build))
    assert len(built) == 1 and plans[0] is plans[1] is plans[2]


def test_documents_entries_keep_the_latest_keep_the_oldest_out_first(seam):
    masks, checks = seam
    tensors = [torch.tensor([0, 1 + i, N]) for i in range(KEEP + 1)]
    for cu in tensors[:KEEP]:
        masks.agreed(cu, cu.tolist())
    masks.mask(Q, True, None, tensors[0], None)                   # a hit: one lookup, the entry keeps its place
    masks.agreed(tensors[KEEP], tensors[KEEP].tolist())           # one more pushes out the oldest
    assert all(masks.documents(cu).agreed for cu in tensors[1:])
    assert not masks.documents(tensors[0]).agreed                 # (a lookup that misses makes a new entry)
    assert checks == []


def test_a_documents_entry_keeps_keep_masks_and_its_masks_go_with_it(seam):
    masks, checks = seam
    cu = torch.tensor([0, 5, N])
    masks.agreed(cu, [0, 5, N])
    kinds = [masks.mask(Q, True, None, cu, w) for w in range(1, KEEP + 1)]        # KEEP layer kinds
    assert all(masks.mask(Q, True, None, cu, w) is kinds[w - 1] for w in range(1, KEEP + 1))
    masks.mask(Q, True, None, cu, KEEP + 1)                       # one more kind pushes out window 1
    assert all(masks.mask(Q, True, None, cu, w) is kinds[w - 1] for w in range(2, KEEP + 1))
    rebuilt = masks.mask(Q, True, None, cu, 1)
    assert rebuilt == kinds[0] and rebuilt is not kinds[0], "the oldest mask was rebuilt"
    for i in range(KEEP):                                         # KEEP later batches push the entry out
        masks.agreed(torch.tensor([0, 1 + i, N]), [0, 1 + i, N])
    assert masks.mask(Q, True, None, cu, KEEP) is not kinds[KEEP - 1]
    assert checks == [(0, 5, N)], "a pushed-out entry is checked again, once"


def test_linear_attention_gets_the_checked_documents_of_the_shards(seam):
    masks, checks = seam
    cu = torch.tensor([0, 5, N])
    docs = masks.linear_documents(cu, Q)
    assert (docs.bounds, docs.padded_len) == ((0, 5, N), N) and checks == [(0, 5, N)]
    masks.linear_documents(cu, Q)
    assert checks == [(0, 5, N)]
