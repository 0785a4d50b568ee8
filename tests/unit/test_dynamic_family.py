"""The dynamic runtime's group family (ds_seqpar/schedule/family.py), pure: which sizes exist, which
run the 2D hybrid, the groups built for them (docs/dynamic.md's table), and the refusals a rank
raises before building any group."""
import pytest

from ds_seqpar.config import ConfigError, SequenceParallelConfig
from ds_seqpar.dynamic import check_dynamic_heads, static_config
from ds_seqpar.schedule import (check_max_tokens, family_groups, family_sizes, group_sizes, price, schedule,
                                ulysses_degree)
from ds_seqpar.topology import ParallelDims


def built_groups(world, sizes, ulysses_size):
    """What ProcessGroups builds for each size's SequenceParallel (data_groups=False), as rank lists."""
    out = {tuple(range(world))} | {(r,) for r in range(world)}
    for s in sizes:
        dims = ParallelDims(world, s, ulysses_degree(s, ulysses_size))
        for ranks in dims.sp_group_ranks() + dims.ulysses_group_ranks() + dims.ring_group_ranks():
            out.add(tuple(ranks))
    return out


def test_groups_a_2d_hybrid_runs_on():
    """U divides the group: U x (s/U); a smaller group runs the ring alone (any size, no head rule)."""
    assert [ulysses_degree(s, 2) for s in (1, 2, 4, 8)] == [1, 2, 2, 2]
    assert [ulysses_degree(s, 8) for s in (1, 2, 4, 8, 16)] == [1, 1, 1, 8, 8]
    cfg = SequenceParallelConfig.parse({"strategy": "zigzag", "size": "dynamic", "max_tokens_per_rank": 16,
                                        "ulysses_size": 4})
    assert [(c.size, c.ulysses_size, c.ring_size) for c in (static_config(cfg, s) for s in (2, 4, 8))] == \
        [(2, 1, 2), (4, 4, 1), (8, 4, 2)]


def test_the_2d_family_at_four_ranks():
    """The world, one-rank groups, the pairs (size 2: an all-to-all of 2), and size 4's rings."""
    assert family_groups(4, (1, 2, 4), 2) == [(0, 1, 2, 3), (0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 2), (1, 3)]


@pytest.mark.parametrize("world", [8, 12, 64])
@pytest.mark.parametrize("u", [1, 2, 4])
def test_the_family_is_what_the_groups_of_every_size_build(world, u):
    sizes = family_sizes("zigzag", world, 8, u)
    family = family_groups(world, sizes, u)
    assert len(family) == len(set(family)) and set(family) == built_groups(world, sizes, u)


@pytest.mark.parametrize("world, u, groups, mine", [(8, 2, 21, 6), (64, 2, 189, 12), (1024, 2, 3069, 20),
                                                    (8, 8, 15, 4), (64, 8, 183, 10), (1024, 8, 3063, 18)])
def test_the_2d_family_is_built_once_and_small(world, u, groups, mine):
    """docs/dynamic.md's table: handles built, and groups one rank is a member of (its communicators);
    without the hybrid: test_dynamic_schedule.py."""
    family = family_groups(world, group_sizes(world), u)
    assert len(family) == groups
    assert max(sum(1 for g in family if r in g) for r in range(world)) == mine


def test_every_all_to_all_stays_inside_a_node_of_u_ranks():
    """Aligned blocks of U neighbouring ranks: with U ranks per node (launchers place consecutive
    ranks on one host) no all-to-all crosses nodes, at every size that runs the hybrid."""
    for s in (8, 16, 64):
        for ranks in ParallelDims(64, s, ulysses_degree(s, 8)).ulysses_group_ranks():
            assert len({r // 8 for r in ranks}) == 1, ranks


def test_the_hybrid_is_priced_on_the_groups_that_run_it():
    assert price(4096, 4, "zigzag", ulysses_size=2) != price(4096, 4, "zigzag")
    assert price(4096, 2, "zigzag", ulysses_size=4) == price(4096, 2, "zigzag")       # ring alone below U
    s = schedule([60, 30, 10, 12], 4, 16, (1, 2, 4), "zigzag", ulysses_size=2)
    assert s.group_sizes == [1, 2, 4]


@pytest.mark.parametrize("call, words", [
    (lambda: family_sizes("ulysses", 4, 3), ["strategy='ulysses' with size='dynamic'", "1 divides the 3 heads",
                                             "use zigzag, ring or striped"]),
    (lambda: family_sizes("zigzag", 4, 8, 3), ["ulysses_size=3 with size='dynamic' must divide the world size 4",
                                               "valid values here: [1, 2, 4]"]),
    (lambda: family_sizes("zigzag", 6, 4, 4), ["ulysses_size=4", "valid values here: [1, 2]"]),
    (lambda: check_dynamic_heads(_cfg("ulysses"), None, None), ["strategy='ulysses'", "needs the model's heads"]),
    (lambda: check_dynamic_heads(_cfg("zigzag", 2), None, None), ["ulysses_size=2 needs the model's heads",
                                                                  "sequence_parallel.ulysses_size=2 must divide"]),
    (lambda: check_dynamic_heads(_cfg("ring", 4), 6, 6), ["ulysses_size=4 with size='dynamic'", "6 heads",
                                                          "dividing 6 (1, 2, 3, 6)"]),
    (lambda: check_max_tokens("zigzag", (1, 2, 4), 1), ["max_tokens_per_rank=1 with strategy='zigzag'",
                                                        "use a multiple of 2 (e.g. 2)"]),
    (lambda: check_max_tokens("zigzag", (1, 2, 4), 511), ["max_tokens_per_rank=511", "(e.g. 510)"]),
])
def test_bad_dynamic_families_name_the_key_the_value_and_what_works(call, words):
    """Raised from the config, the world size and the model's heads alone: every rank, before any group."""
    with pytest.raises(ConfigError) as err:
        call()
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_budgets_every_layout_splits_within():
    for strategy in ("ulysses", "ring", "striped", "lasp"):
        check_max_tokens(strategy, (1, 2, 4), 1)
    check_max_tokens("zigzag", (1, 2, 4), 2)
    check_max_tokens("zigzag", (1, 2, 4), 3, ulysses_size=2)      # 2 x 1 and 2 x 2: U ranks share a chunk


def _cfg(strategy, u=1):
    return SequenceParallelConfig.parse({"strategy": strategy, "size": "dynamic", "max_tokens_per_rank": 16,
                                         "ulysses_size": u})
