"""Training-level reliability: checkpoints move between strategies and sequence-parallel sizes,
and runs are deterministic."""
import pytest

from ..e2e.test_train_e2e import TINY, _train, assert_close_losses, shipped_config


def _config(name, sp_size, micro_batch):
    ds = shipped_config(name)
    ds["sequence_parallel"]["size"] = sp_size
    ds["train_micro_batch_size_per_gpu"] = micro_batch
    ds.pop("train_batch_size", None)
    return ds


@pytest.mark.parametrize("target,sp_size,micro_batch", [("striped", 2, 1), ("ulysses", 4, 2)],
                         ids=["zigzag-sp2-to-striped-sp2", "zigzag-sp2-dp2-to-ulysses-sp4-dp1"])
def test_checkpoint_resumes_under_another_strategy_and_size(pool, tmp_path, target, sp_size, micro_batch):
    """Saved by zigzag (sp=2 x dp=2, 1 sequence per replica), resumed by another strategy; with
    sp=4 the single replica takes both sequences (micro batch 2), so the global batch is the same.
    ZeRO shards over the sequence x data group (the whole world) either way, so the checkpoint
    layout does not depend on the strategy or on sp."""
    args = dict(TINY, steps=4, ignore_frac=0.0, run_dir=str(tmp_path / "runs"))
    save = str(tmp_path / "ckpt")
    source = _config("zigzag", 2, 1)
    whole = pool.run(_train, dict(args, deepspeed_config=source))
    pool.run(_train, dict(args, deepspeed_config=source, steps=2, save_dir=save, save_interval=2))
    resumed = pool.run(_train, dict(args, deepspeed_config=_config(target, sp_size, micro_batch),
                                    save_dir=save, resume=True))
    # equal valid-token counts per sequence (no ignored labels): mean of replica means == global mean
    for r in resumed:
        assert r["start_step"] == 2, r
        assert_close_losses(r["mean_losses"], whole[0]["mean_losses"][2:], f"{target} sp={sp_size} resumed")


def test_same_seed_same_losses(pool, tmp_path):
    args = dict(TINY, deepspeed_config=shipped_config("striped"), run_dir=str(tmp_path))
    first = pool.run(_train, args)
    second = pool.run(_train, args)
    for a, b in zip(first, second):
        assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"], (a["losses"], b["losses"])
