"""The mask value (ds_seqpar/masks.py): its key spans against the predicates written out pair by pair,
its documents and real length, and the one rule for a window that covers the sequence."""
from __future__ import annotations

import pytest
import torch

from ds_seqpar.masks import Mask, chunk_bounds, cut_documents, effective_window, seen_keys


def _brute(seq, real, causal, window, bounds):
    """bool [seq, seq]: query q sees key k, each predicate written out on its own."""
    doc = [next((i for i in range(len(bounds) - 1) if bounds[i] <= t < bounds[i + 1]), -1) for t in range(seq)]
    w = window or seq + 1
    return torch.tensor([[q < real and k < real and doc[q] == doc[k] and q - w < k and (k <= q if causal else k - q < w)
                          for k in range(seq)] for q in range(seq)])


CASES = [(None, None, 24, 24), (5, None, 24, 24), (None, (7, 10, 4), 24, 21), (3, (7, 10, 4), 24, 21),
         (None, None, 24, 19), (6, None, 24, 19), (30, (12, 12), 24, 24)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window,docs,seq,real", CASES)
def test_key_spans_are_the_predicates(causal, window, docs, seq, real):
    mask = Mask(causal, window, docs, None if docs else real)
    want = _brute(seq, real, causal, window, [0, *torch.tensor(docs or (real,)).cumsum(0).tolist()])
    pos = torch.arange(seq)
    assert torch.equal(mask.visible(pos, pos, seq), want)
    lo, hi = mask.key_spans(pos, seq)
    assert torch.equal((hi - lo).clamp(min=0), want.sum(1))
    assert torch.equal(seen_keys(real, seq, Mask(causal, window, docs)), want.sum(1))


def test_from_boundaries_keeps_documents_and_real_length():
    mask = Mask.from_boundaries([0, 3, 10], causal=False, window=4)
    assert (mask.docs, mask.real_len, mask.causal, mask.window) == ((3, 7), 10, False, 4)
    assert mask.bounds(16) == [0, 3, 10] and mask.real(16) == 10 and not mask.is_plain(10)
    one = Mask.from_boundaries([0, 10])
    assert one.docs is None and one.real_len == 10 and one.is_plain(10) and not one.is_plain(12)
    assert Mask.from_boundaries(None, real_len=9).bounds(12) == [0, 9]


def test_with_options_keeps_the_documents_and_reuses_itself():
    mask = Mask.from_boundaries([0, 4, 8])
    assert mask.with_options(True, None) is mask
    windowed = mask.with_options(False, 3)
    assert (windowed.docs, windowed.real_len, windowed.causal, windowed.window) == ((4, 4), 8, False, 3)


def test_a_window_that_covers_the_sequence_is_no_window():
    assert effective_window(None, 8) is None
    assert effective_window(8, 8) is None and effective_window(9, 8) is None
    assert effective_window(7, 8) == 7
    assert Mask(True, 8).for_length(8) == Mask(True, None)
    assert Mask(True, 7, (5, 5)).for_length(8) == Mask(True, 7, (5, 3))


def test_cut_documents():
    assert cut_documents(None, 5) is None
    assert cut_documents((4, 4), 6) == (4, 2)
    assert cut_documents((4,), 6) == (4, 2)
    assert cut_documents((8, 8), 6) is None


def test_chunked_attention_is_documents_cut_at_every_chunk():
    assert chunk_bounds(None, 4, 10) == [0, 4, 8, 10]
    assert chunk_bounds([0, 3, 10], 4, 10) == [0, 3, 4, 8, 10]
    mask = Mask.from_boundaries([0, 3, 10], window=2).chunked(4, 12)
    assert (mask.docs, mask.real_len, mask.window) == ((3, 1, 4, 2), 10, 2)
    pos = torch.arange(12)
    same_chunk = (pos[:, None] // 4 == pos[None, :] // 4) & (pos[:, None] < 10) & (pos[None, :] < 10)
    assert not (mask.visible(pos, pos, 12) & ~same_chunk).any()


def test_batch_masks_know_documents_by_object_version_and_value():
    """sp.attention's memo (sp.masks, sharding/batch_masks.py): the same tensor is the same documents until written in
    place; a list by its values (the attention op receives a copy of the caller's list); None is one
    entry too."""
    from ds_seqpar.comm import CommStats
    from ds_seqpar.sharding.batch_masks import BatchMasks
    memo = BatchMasks(None, CommStats(), 1, 1)
    cu = torch.tensor([0, 4, 8])
    first = memo.documents(cu)
    first.agree([0, 4, 8])
    assert memo.documents(cu) is first and first.agreed
    cu[1] = 5                                                      # written in place: new documents
    assert memo.documents(cu) is not first and not memo.documents(cu).agreed
    bounds = [0, 2, 8]
    listed = memo.documents(bounds)
    listed.agree(bounds)
    assert memo.documents(bounds) is listed
    bounds[1] = 3
    assert memo.documents(bounds) is not listed
    assert memo.documents(None) is memo.documents(None)
    assert memo.documents([0, 3, 8]) is memo.documents([0, 3, 8])         # another list, the same values
