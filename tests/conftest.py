"""One pool of 4 CPU gloo ranks for the whole session (process start + imports are slow on 2 cores).

Tests at 2 ranks use sequence_parallel.size=2 on this world, i.e. two independent sequence groups
of 2 ranks (dp=2): a sweep of several configs splits them between the groups, a single case runs on the
first group alone (tests/dist_checks.py: group_shares, first_group_runs), and the rest check theirs on both.
"""
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

WORLD = 4
COLLECTED = pytest.StashKey[set]()      # the test files this session collected (tests/unit/test_collection.py)


def pytest_itemcollected(item):
    # before any -k / -m deselection: what the command line collects, not what it runs
    item.config.stash.setdefault(COLLECTED, set()).add(item.nodeid.split("::")[0])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist's --dist loadgroup (setup.cfg's addopts), one worker runs every test on the session's
    # rank pools, so the pools start once; another runs the hosts tier, whose network namespaces and addresses
    # are fixed names; the rest (launches, unit tests) spread over the workers. Without xdist the marks are inert.
    for item in items:
        if {"pool", "pool2"} & set(item.fixturenames):
            item.add_marker(pytest.mark.xdist_group("rank_pools"))
        elif item.get_closest_marker("multinode"):
            item.add_marker(pytest.mark.xdist_group("hosts"))


@pytest.fixture(scope="session")
def pool():
    from ds_seqpar.launch.rankpool import RankPool
    p = RankPool(WORLD, timeout_s=180.0).start()
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool2():
    """2 CPU gloo ranks, started on first use: plain data parallelism with as many processes as a size-2 run on
    the 4-rank pool has replicas (TRL's GRPO: each process seeds and samples by its own index)."""
    from ds_seqpar.launch.rankpool import RankPool
    p = RankPool(2, timeout_s=180.0).start()
    yield p
    p.close()
