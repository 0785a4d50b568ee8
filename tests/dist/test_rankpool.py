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
