"""ShardedKVCache without processes: the prefill keeps this rank's real tokens (not the layout's end
padding) and hands the shard back as it came, decode appends on the owner only, the shares follow
next_owner, the global length is what generate numbers positions from, and a window layer keeps only
what the next query sees."""
import pytest
import torch

from ds_seqpar.sharding.layouts import make_layout

pytest.importorskip("transformers")


def _kv(n, fill):
    return torch.full((1, 2, n, 4), float(fill)), torch.full((1, 2, n, 4), -float(fill))


@pytest.mark.parametrize("rank", [0, 1])
def test_prefill_then_decode_keeps_this_ranks_tokens(rank):
    from ds_seqpar.hf.kv_cache import ShardedKVCache
    layout, n, padded = make_layout("zigzag", 2), 13, 16          # 3 padding tokens, all on rank 0 (chunk 3)
    cache = ShardedKVCache(2, [False, True], 2, rank)
    pos = layout.indices(padded, rank)
    cache.begin_prefill(layout, n, padded, pos)
    assert cache.shares == [5, 8]
    for i in range(2):
        k, v = _kv(pos.numel(), i + 1)
        got_k, _ = cache.update(k, v, i)
        assert got_k is k                                         # the strategy's shard, untouched
    full, window = cache.layers
    assert full.positions.tolist() == [p for p in pos.tolist() if p < n]
    window.trim(4, n)                                             # the next query (13) sees 10, 11, 12
    assert window.positions.tolist() == [p for p in pos.tolist() if n - 4 < p < n]
    cache.end_step()
    assert cache.get_seq_length() == n and cache.layers[0].get_seq_length() == n
    for step in range(5):                     # owners 0, 0, 0 (to 8 / 8), 0 (a tie: the lowest rank), then 1
        position = cache.begin_decode()
        assert position == n + step and cache.owner == (0 if step < 4 else 1)
        before = full.positions.numel()
        got_k, _ = cache.update(*_kv(1, 9), 0)
        assert full.positions.numel() == before + (cache.owner == rank) and got_k is full.keys
        cache.end_step()
    assert cache.shares == [9, 9] and cache.seen == n + 5
    assert full.positions.numel() == cache.shares[rank] and full.keys.shape[2] == cache.shares[rank]


def test_the_cache_refuses_what_generate_does_not_do():
    from ds_seqpar.hf import UnsupportedModelError
    from ds_seqpar.hf.kv_cache import ShardedKVCache
    cache = ShardedKVCache(1, [False], 2, 0)
    with pytest.raises(UnsupportedModelError, match="model.generate of an applied model only"):
        cache.update(*_kv(3, 1), 0)
    with pytest.raises(UnsupportedModelError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(UnsupportedModelError, match="assisted decoding"):
        cache.crop(-1)


@pytest.mark.parametrize("rank", [0, 1])
def test_left_padded_rows_keep_slots_with_their_own_positions(rank):
    """Rows rotated so their real tokens lead (hf/generate.py): one slot per global index in every row, a row's
    pads at PAD, its decode tokens at its length + steps; a window layer keeps the slots some row still sees."""
    from ds_seqpar.hf.kv_cache import PAD, ShardedKVCache
    layout, n, padded = make_layout("zigzag", 2), 13, 16
    lengths = torch.tensor([13, 9])
    cache = ShardedKVCache(2, [False, True], 2, rank)
    pos = layout.indices(padded, rank)
    cache.begin_prefill(layout, n, padded, pos, lengths)
    for i in range(2):
        cache.update(torch.zeros(2, 2, pos.numel(), 4), torch.zeros(2, 2, pos.numel(), 4), i)
    full, window = cache.layers
    kept = torch.tensor([p for p in pos.tolist() if p < n])
    assert torch.equal(full.positions, kept)
    assert full.row_positions[0].tolist() == kept.tolist()
    assert full.row_positions[1].tolist() == [p if p < 9 else PAD for p in kept.tolist()]
    window.trim(4, n)             # row 0's next query (13) sees 10..12, row 1's (9) sees 6..8
    assert window.positions.tolist() == [p for p in kept.tolist() if 6 <= p <= 8 or 10 <= p <= 12]
    cache.end_step()
    for step in range(3):
        assert cache.begin_decode() == n + step
        cache.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4), 0)
        if cache.owner == rank:
            assert full.row_positions[:, -1].tolist() == [13 + step, 9 + step]
        cache.end_step()
    assert full.row_positions.shape == (2, full.positions.numel()) == (2, cache.shares[rank])
