"""The rank pool fails loudly, with the failing rank's traceback, and never hangs."""
import pytest
import torch

from ds_seqpar import comm
from ds_seqpar.launch.rankpool import RankFailure, RankPool


def _rank_one_raises_others_block():
    if comm.global_rank() == 1:
        raise RuntimeError("boom on rank one")
    x = torch.ones(1)
    comm.all_reduce(x, None)     # peers wait for rank 1, which never arrives
    return x.item()


def _world_sum():
    x = torch.ones(1)
    comm.all_reduce(x, None)
    return x.item()


def test_failure_on_one_rank_is_reported_and_pool_recovers():
    pool = RankPool(2, timeout_s=60.0, grace_s=2.0).start()
    try:
        with pytest.raises(RankFailure) as err:
            pool.run(_rank_one_raises_others_block, timeout=30)
        msg = str(err.value)
        assert "rank 1 raised" in msg and "boom on rank one" in msg, msg
        assert "did not finish" in msg, msg        # rank 0 was stuck in the collective and killed
        assert pool.run(_world_sum) == [2.0, 2.0]  # restarted transparently
    finally:
        pool.close()


def test_results_come_back_in_rank_order(pool):
    assert pool.run(comm.global_rank) == [0, 1, 2, 3]


def _seen(name):
    import os
    import sys
    return os.environ.get(name), "transformers.modeling_utils" in sys.modules


def test_forked_ranks_see_the_parent_environment_of_now_and_the_preloaded_modules(pool, monkeypatch):
    # the session pool's fork server started before this variable existed; a rank forked from it now sees it
    monkeypatch.setenv("DS_SEQPAR_TEST_POOL_ENV", "now")
    fresh = RankPool(2, timeout_s=60.0).start()
    try:
        assert fresh.run(_seen, "DS_SEQPAR_TEST_POOL_ENV") == [("now", True)] * 2   # tests/conftest.py preloads it
    finally:
        fresh.close()


def test_an_environment_read_at_process_start_gets_spawned_ranks(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    spawned = RankPool(1, timeout_s=60.0)
    spawned.start()
    try:
        assert spawned.method == spawned._procs[0]._popen.method == "spawn"
        assert [seen for seen, _ in spawned.run(_seen, "MALLOC_MMAP_THRESHOLD_")] == ["65536"]
    finally:
        spawned.close()
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    forked = RankPool(1, timeout_s=60.0).start()
    try:
        assert forked.method == forked._procs[0]._popen.method == "forkserver"
    finally:
        forked.close()
    with pytest.raises(ValueError, match="start_method='fork': choose 'forkserver' or 'spawn'"):
        RankPool(1, start_method="fork")
