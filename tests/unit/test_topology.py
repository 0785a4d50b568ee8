"""Rank arithmetic, pure: no processes."""
import pytest

from ds_seqpar.topology import ParallelDims


def test_coordinates_8_ranks_2x2x2():
    dims = ParallelDims(world_size=8, sp_size=4, ulysses_size=2)
    assert (dims.dp_size, dims.ring_size) == (2, 2)
    got = [(c.dp_rank, c.ring_rank, c.ulysses_rank, c.sp_rank) for c in map(dims.coords, range(8))]
    assert got == [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 2), (0, 1, 1, 3),
                   (1, 0, 0, 0), (1, 0, 1, 1), (1, 1, 0, 2), (1, 1, 1, 3)]


@pytest.mark.parametrize("world,sp,u", [(4, 2, 1), (8, 4, 2), (8, 8, 4), (6, 3, 1), (12, 6, 3), (4, 4, 4)])
def test_groups_partition_the_world(world, sp, u):
    dims = ParallelDims(world, sp, u)
    for groups, size in ((dims.sp_group_ranks(), sp), (dims.dp_group_ranks(), world // sp),
                         (dims.ulysses_group_ranks(), u), (dims.ring_group_ranks(), sp // u)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), groups
        assert all(len(g) == size for g in groups), groups
    for r in range(world):
        c = dims.coords(r)
        assert r == c.dp_rank * sp + c.ring_rank * u + c.ulysses_rank
        # group members agree on the coordinate the group does not vary
        ring = next(g for g in dims.ring_group_ranks() if r in g)
        assert [dims.coords(x).ring_rank for x in ring] == list(range(sp // u))
        assert {dims.coords(x).ulysses_rank for x in ring} == {c.ulysses_rank}
        dp = next(g for g in dims.dp_group_ranks() if r in g)
        assert {dims.coords(x).sp_rank for x in dp} == {c.sp_rank}


def test_ulysses_groups_are_neighbouring_ranks():
    dims = ParallelDims(16, 8, 4)
    assert dims.ulysses_group_ranks()[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("world,sp,u,needle", [(4, 3, 1, r"size=3 does not divide the world size 4; valid sizes "
                                                         r"for this world: \[1, 2, 4\]"),
                                               (8, 4, 3, "ulysses_size=3 must divide sequence_parallel.size=4")])
def test_bad_dims(world, sp, u, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelDims(world, sp, u)
