"""The dynamic scheduler (ds_seqpar/schedule): pure, without processes. Capacity, smallest groups,
aligned groups, rounds that every rank runs, balance on real lengths, determinism, bad input."""
import os

import numpy as np
import pytest

from ds_seqpar.schedule import Group, ModelShape, family_groups, group_sizes, price, schedule

LENGTHS = os.path.join(os.path.dirname(__file__), "..", "data", "lengths")


def real_batch(name, tokens, cap, seed=0):
    """Documents drawn from a real length distribution until ``tokens``, cut at ``cap``."""
    lengths = np.loadtxt(os.path.join(LENGTHS, name), dtype=np.int64)
    rng, docs = np.random.default_rng(seed), []
    while sum(docs) < tokens:
        docs.append(int(min(lengths[rng.integers(lengths.size)], cap)))
    return docs


def check_schedule(s, lengths, world, t, sizes):
    """Every document once, on the smallest group that holds it, aligned; each round a partition."""
    placed = []
    for row in s.rounds:
        assert len(row) == world
        for rank, mb in enumerate(row):
            assert rank in mb.group.ranks and mb.group.first % mb.group.size == 0, (rank, mb.group)
            assert all(row[r] is mb for r in mb.group.ranks), f"ranks of {mb.group} disagree"
            assert mb.tokens <= mb.group.size * t and mb.cu_seqlens[-1] == mb.tokens
            assert mb.loss_tokens == sum(n - 1 for n in lengths)
            if rank == mb.group.first:
                placed += mb.documents
        for mb in row:
            if len(mb.documents) == 1 and mb.group.size > 1:
                n = lengths[mb.documents[0]]
                smaller = [g for g in sizes if g < mb.group.size]
                assert not smaller or max(smaller) * t < n, f"document of {n} tokens on {mb.group.size} ranks"
            if mb.group.size == 1:
                assert all(lengths[d] <= t for d in mb.documents)
    assert sorted(placed) == list(range(len(lengths))), "every document exactly once"


def test_the_docstring_example():
    s = schedule([700, 90, 300, 60, 250], 4, 400, (1, 2, 4))
    assert len(s.rounds) == 1
    (a, b, c, d), = s.rounds
    assert a is b and a.group == Group(2, 0) and a.lengths == (700,)
    assert (c.lengths, d.lengths) == ((300, 60), (90, 250)) and c.cu_seqlens == (0, 300, 360)
    assert s.loss_tokens == 1395 and s.group_sizes == [1, 2]


@pytest.mark.parametrize("name, world, t", [("wikipedia_5k.txt", 4, 1024), ("wikipedia_5k.txt", 8, 512),
                                           ("wlbllm_5k.txt", 4, 4096), ("wlbllm_5k.txt", 64, 2048)])
def test_real_lengths_are_placed_within_capacity_and_balanced(name, world, t):
    sizes = group_sizes(world)
    docs = real_batch(name, 4 * world * t, world * t)
    s = schedule(docs, world, t, sizes, "zigzag")
    check_schedule(s, docs, world, t, sizes)
    assert s.imbalance < 1.10, f"{name} at {world} ranks, T={t}: imbalance {s.imbalance:.3f}"
    # nothing is wasted on rounds: no more than twice the token lower bound, plus one per long size
    assert len(s.rounds) <= 2 * -(-sum(docs) // (world * t)) + len(sizes)
    assert schedule(docs, world, t, sizes, "zigzag") == s, "the same lengths give the same schedule"


def test_every_rank_runs_the_same_rounds_with_empty_micro_batches_where_it_has_nothing():
    # one 4-rank document that fills its group, then one short one (no room left beside the long one)
    s = schedule([8192, 10], 4, 2048, (1, 2, 4))
    assert len(s.rounds) == 2 and all(len(s.for_rank(r)) == 2 for r in range(4))
    empty = [mb for r in range(4) for mb in s.for_rank(r) if mb.empty]
    assert len(empty) == 3 and all(mb.tokens == 0 and mb.loss_tokens == 8200 for mb in empty)


def test_short_documents_take_the_room_a_long_one_leaves_before_a_new_round():
    s = schedule([5000, 10], 4, 2048, (1, 2, 4))
    (mb, *_), = s.rounds
    assert mb.group.size == 4 and mb.lengths == (5000, 10) and mb.cu_seqlens == (0, 5000, 5010)
    docs = real_batch("wikipedia_5k.txt", 8 * 2048, 2048)
    # the fewest rounds the tokens allow, plus at most one for what does not pack
    assert len(schedule(docs, 4, 512, (1, 2, 4), "zigzag").rounds) <= -(-sum(docs) // 2048) + 1


def test_ulysses_groups_divide_the_heads():
    assert group_sizes(8) == (1, 2, 4, 8) and group_sizes(6) == (1, 2, 6) and group_sizes(8, heads=6) == (1, 2)
    with pytest.raises(ValueError, match="document 0 has 3000 tokens, more than the largest group holds: "
                                         "2 ranks x sequence_parallel.max_tokens_per_rank=1000 = 2000"):
        schedule([3000], 8, 1000, group_sizes(8, heads=6), "ulysses")


@pytest.mark.parametrize("world, groups, mine", [(8, 15, 4), (64, 127, 7), (1024, 2047, 11)])
def test_the_group_family_is_built_once_and_small(world, groups, mine):
    """The world, the one-rank groups, each size's aligned groups: (world - 2) + world + 1 handles,
    of which a rank is a member of log2(world) + 2 (docs/dynamic.md's table)."""
    family = family_groups(world, group_sizes(world))
    assert len(family) == len(set(family)) == groups
    assert sum(1 for g in family if 5 in g) == mine


def test_price_grows_with_length_and_shrinks_with_the_group():
    shape = ModelShape()
    for strategy in ("ulysses", "ring", "zigzag", "striped", "lasp"):
        assert price(200, 1, strategy, shape) < price(400, 1, strategy, shape)
        assert price(4000, 2, strategy, shape) < price(4000, 1, strategy, shape), strategy
    # quadratic attention: a long document costs more than the same tokens in short ones
    assert price(2048, 1, "zigzag") > 8 * price(256, 1, "zigzag")
    # the ring's contiguous layout leaves its last rank the most causal work
    assert price(4096, 4, "ring") > price(4096, 4, "zigzag")


@pytest.mark.parametrize("lengths, sizes, words", [
    ([10, 0], (1, 2), "document 1 has length 0"),
    ([10, -3], (1, 2), "document 1 has length -3"),
    ([10, 2.5], (1, 2), "document 1 has length 2.5"),
    ([10], (1, 3), "divide the world size 4"),
    ([10], (2, 3, 6), "each a multiple of the smallest"),
    ([9000], (1, 2, 4), "add ranks, or cut documents to 4096 tokens"),
])
def test_bad_input_names_the_document_and_what_works(lengths, sizes, words):
    with pytest.raises(ValueError, match=words):
        schedule(lengths, 6 if 6 in sizes else 4, 1024, sizes)


def test_one_size_is_static_sequence_parallelism_over_packed_rows():
    """sizes=(2,) at 4 ranks: every document on a 2-rank group, packed into rows of 2 x T tokens,
    the two replicas' groups (ranks 0-1, 2-3) taking rows in turn by cost."""
    docs = real_batch("wikipedia_5k.txt", 8 * 256, 512)
    s = schedule(docs, 4, 256, (2,))
    check_schedule(s, docs, 4, 256, (2,))
    assert s.group_sizes == [2] and len(s.rounds) <= -(-sum(docs) // 1024) + 2
    assert all(mb.group.first in (0, 2) for row in s.rounds for mb in row)
