"""comm.py's verbs on the 4-rank pool, each against what it must compute, written out by hand from
every rank's input (inputs are seeded by global rank, so each rank rebuilds its peers' tensors):
forward values, the backward duals (all-to-all <-> the reverse all-to-all, all-gather <->
reduce-scatter of the sum, a replicated all-reduce <-> identity), the ring exchange in both
directions, and the bytes and calls CommStats records. A bug in comm fails here, next to its cause,
rather than as a wrong gradient three layers up.

Every check runs on the whole world (4 ranks) and on two groups of 2 ([0, 1] and [2, 3]), where
group-relative ranks differ from global ones. Values are float64 and moved, not computed, so the
comparisons are exact (the reduce-scatter's sum is taken in the same rank order as comm's).
"""
import pytest
import torch

from ds_seqpar import comm

WORLD = [0, 1, 2, 3]
PAIRS = [[0, 1], [2, 3]]


def _groups():
    """[(group, its global ranks)] this rank belongs to; every rank creates every group (a collective)."""
    world = comm.new_group(WORLD, 60.0)
    pairs = [comm.new_group(ranks, 60.0) for ranks in PAIRS]
    me = comm.global_rank()
    return [(world, WORLD), (pairs[me // 2], PAIRS[me // 2])]


def _on_every_group(check) -> int:
    """``check(group, its global ranks, this rank's index in it)`` on each group of this rank (it
    asserts); the number of groups checked."""
    me = comm.global_rank()
    groups = _groups()
    for group, ranks in groups:
        check(group, ranks, ranks.index(me))
    return len(groups)


def _tensor(global_rank: int, shape, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + global_rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_all_to_all(group, ranks, r):
    p = len(ranks)
    for scatter, gather in ((2, 1), (1, 2)):
        shape = [2, 2 * p, 2 * p, 3]                       # [b, s, h, d]: both dims split over p
        out_shape = list(shape)
        out_shape[scatter], out_shape[gather] = shape[scatter] // p, shape[gather] * p
        xs = [_tensor(j, shape, 1) for j in ranks]          # x of every group rank, in group order
        grads = [_tensor(j, out_shape, 2) for j in ranks]   # the upstream gradient of every rank's output
        stats = comm.CommStats()
        x = xs[r].clone().requires_grad_()
        y = comm.all_to_all(x, scatter, gather, group, stats)
        # rank r receives piece r (along the scattered dim) of every rank's x, in rank order
        want_y = torch.cat([xs[j].chunk(p, scatter)[r] for j in range(p)], dim=gather)
        assert torch.equal(y, want_y), f"all_to_all({scatter}->{gather}) forward, group {ranks}, rank {r}"
        assert (stats.bytes["all_to_all"], stats.calls["all_to_all"]) == (_nbytes(x) * (p - 1) // p, 1), stats
        y.backward(grads[r])
        # dual: piece j of x went to rank j, where it sits as piece r (along the gathered dim)
        want_dx = torch.cat([grads[j].chunk(p, gather)[r] for j in range(p)], dim=scatter)
        assert torch.equal(x.grad, want_dx), f"all_to_all({scatter}->{gather}) backward, group {ranks}, rank {r}"
        assert (stats.bytes["all_to_all"], stats.calls["all_to_all"]) == (2 * _nbytes(x) * (p - 1) // p, 2), stats



def _check_all_gather(group, ranks, r):
    p = len(ranks)
    xs = [_tensor(j, (2, 3, 5), 3) for j in ranks]
    grads = [_tensor(j, (2, 3 * p, 5), 4) for j in ranks]
    stats = comm.CommStats()
    x = xs[r].clone().requires_grad_()
    y = comm.all_gather(x, 1, group, stats)
    assert torch.equal(y, torch.cat(xs, dim=1)), f"all_gather forward, group {ranks}, rank {r}"
    assert (stats.bytes["all_gather"], stats.calls["all_gather"]) == (_nbytes(x) * (p - 1), 1), stats
    y.backward(grads[r])
    # dual: every rank's copy of the output used x, so x's gradient sums piece r of every grad
    want_dx = torch.stack([g.chunk(p, 1)[r] for g in grads]).sum(0)
    assert torch.equal(x.grad, want_dx), f"all_gather backward (reduce-scatter), group {ranks}, rank {r}"
    # the reduce-scatter sends (P-1)/P of the P-times-larger gradient: as many bytes as the gather
    assert (stats.bytes["all_gather"], stats.calls["all_gather"]) == (2 * _nbytes(x) * (p - 1), 2), stats
    # the posted forms hand back the same: every rank's tensor in rank order, this rank's summed piece
    assert all(torch.equal(a, b) for a, b in zip(comm.all_gather_async(xs[r], group).wait(), xs))
    assert torch.equal(comm.reduce_scatter_async(grads[r], 1, group).wait(), want_dx)
    assert torch.equal(comm.reduce_scatter(grads[r], 1, group), want_dx)



def _check_ring(group, ranks, r):
    p = len(ranks)
    for shift in (1, -1):                       # forward walk, and the reverse walk of backward passes
        mine = [_tensor(ranks[r], (3, 4), 5), _tensor(ranks[r], (2,), 6)]
        stats = comm.CommStats()
        got = comm.ring_send_recv(mine, group, stats, shift=shift).wait()
        src = ranks[(r - shift) % p]            # the group rank this one receives from
        want = [_tensor(src, (3, 4), 5), _tensor(src, (2,), 6)]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), \
            f"ring shift {shift}, group {ranks}, rank {r}: did not receive global rank {src}'s tensors"
        assert (stats.bytes["ring"], stats.calls["ring"]) == (sum(map(_nbytes, mine)), 1), stats



def _check_all_reduce(group, ranks, r):
    p = len(ranks)
    xs = [_tensor(j, (4, 3), 7) for j in ranks]
    stats = comm.CommStats()
    total = comm.all_reduce(xs[r].clone(), group, stats)
    torch.testing.assert_close(total, torch.stack(xs).sum(0), rtol=0, atol=1e-12)
    assert (stats.bytes["all_reduce"], stats.calls["all_reduce"]) == (2 * _nbytes(xs[r]) * (p - 1) // p, 1), stats
    x = xs[r].clone().requires_grad_()
    upstream = _tensor(99, (4, 3), 8)           # the same on every rank: the output is replicated
    comm.all_reduce_sum(x, group).backward(upstream)
    assert torch.equal(x.grad, upstream), f"all_reduce_sum backward must be the identity, group {ranks}"


@pytest.mark.parametrize("check", [_check_all_to_all, _check_all_gather, _check_ring, _check_all_reduce], ids=[
    "all_to_all_backward_is_the_reverse_all_to_all_of_the_grad",
    "all_gather_backward_is_the_reduce_scatter_of_the_grad",
    "ring_exchange_sends_to_the_next_rank_and_receives_from_the_previous",
    "all_reduce_sums_and_its_replicated_backward_is_the_identity"])
def test_comm_verb(pool, check):
    assert pool.run(_on_every_group, check) == [2] * 4        # the world and this rank's pair, on every rank
