"""The pure pieces of decode with a sequence-sharded cache (strategies/decode.py): the share balance,
the prompt's shares by layout, and the partial attention + rank-order merge + sinks against dense
attention of the last query over every key (float64: exact to rounding), with GQA, a window, a softcap
and a rank that holds no key the query sees."""
import pytest
import torch

from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies.decode import fold_parts, fold_sinks, next_owner, partial_attention, prompt_shares

from ..reference import dense_attention


def test_next_owner_smallest_share_lowest_rank_on_ties():
    assert next_owner([3, 2, 2, 5]) == 1
    assert next_owner([4, 4]) == 0
    shares = [7, 8, 8, 5]                   # a padded prompt's shares, then one token per step
    for _ in range(9):
        shares[next_owner(shares)] += 1
    assert max(shares) - min(shares) <= 1, shares


@pytest.mark.parametrize("name,ring,ulysses", [("contiguous", 4, 1), ("zigzag", 4, 1), ("striped", 2, 1),
                                               ("zigzag", 2, 2)])
def test_prompt_shares_count_the_real_tokens_of_each_rank(name, ring, ulysses):
    layout = make_layout(name, ring, ulysses)
    n = 27
    padded = -(-n // layout.required_multiple) * layout.required_multiple
    shares = prompt_shares(layout, n, padded)
    assert sum(shares) == n
    for r, s in enumerate(shares):
        assert s == int((layout.indices(padded, r) < n).sum())


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (6, None, False), (None, 0.5, True),
                                                  (3, 0.7, True)])
def test_partials_merged_in_rank_order_equal_dense_attention(window, softcap, sinks):
    g = torch.Generator().manual_seed(0)
    b, h, hkv, d, dv, n, p = 2, 4, 2, 8, 6, 19, 4
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, dv, generator=g, dtype=torch.float64)
    s = torch.randn(h, generator=g, dtype=torch.float64) if sinks else None
    scale = d ** -0.5
    want = dense_attention(q, k, v, True, scale, window, softcap, s)[:, -1]         # the last query [b, h, dv]
    owner = torch.randint(0, p - 1, (n,), generator=g)          # rank p - 1 holds no key at all
    owner[:2] = p - 2
    parts = []
    for r in range(p):
        pos = (owner == r).nonzero().flatten()
        kr, vr = (t[:, pos].transpose(1, 2) for t in (k, v))                          # [b, hkv, m, d]
        out, lse = partial_attention(q[:, -1].contiguous(), kr, vr, pos, n - 1, scale, window, softcap)
        if window is not None and not bool((pos > n - 1 - window).any()):
            assert bool(torch.isneginf(lse).all()) and not bool(out.any()), "a rank seeing no key: (0, -inf)"
        parts.append(torch.cat([out.reshape(b, -1), lse], dim=1))
    out, lse = fold_parts(torch.stack(parts), h, dv)
    got = fold_sinks(out, lse, s)
    assert (got - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (5, None, False), (4, 0.7, True)])
def test_left_padded_rows_mask_their_pad_slots(window, softcap, sinks):
    """A left-padded batch's cache (hf/kv_cache.py): every row has the same slots, a row's rotated-away pads carry
    a negative position and hold garbage K/V; each row's merged attention equals dense attention of its last real
    token over its real tokens alone (its positions, its window)."""
    g = torch.Generator().manual_seed(1)
    b, h, hkv, d, dv, n, steps, p = 2, 4, 2, 8, 6, 19, 3, 4
    lengths = [19, 12]                       # row 1: 7 pads rotated to the end of the prompt's slots
    slots = n + steps
    k = 50 * torch.randn(b, slots, hkv, d, generator=g, dtype=torch.float64)      # the pads' K/V: large garbage
    v = 50 * torch.randn(b, slots, hkv, dv, generator=g, dtype=torch.float64)
    q = torch.randn(b, slots, h, d, generator=g, dtype=torch.float64)
    s = torch.randn(h, generator=g, dtype=torch.float64) if sinks else None
    row_pos = torch.full((b, slots), -1, dtype=torch.long)
    for r, length in enumerate(lengths):
        row_pos[r, :length] = torch.arange(length)
        row_pos[r, n:] = torch.arange(length, length + steps)
    q_pos = torch.tensor([length + steps - 1 for length in lengths])
    scale = d ** -0.5
    owner = torch.randint(0, p, (slots,), generator=g)
    parts = []
    for r in range(p):
        mine = (owner == r).nonzero().flatten()
        kr, vr = (t[:, mine].transpose(1, 2) for t in (k, v))
        out, lse = partial_attention(q[:, -1].contiguous(), kr, vr, row_pos[:, mine], q_pos, scale, window, softcap)
        parts.append(torch.cat([out.reshape(b, -1), lse], dim=1))
    out, lse = fold_parts(torch.stack(parts), h, dv)
    got = fold_sinks(out, lse, s)
    for r in range(b):
        real = (row_pos[r] >= 0).nonzero().flatten()            # the row's real tokens, in position order
        want = dense_attention(q[r:r + 1, real], k[r:r + 1, real], v[r:r + 1, real], True, scale, window, softcap,
                               s)[:, -1]
        assert (got[r] - want[0]).abs().max().item() < 1e-12, r
