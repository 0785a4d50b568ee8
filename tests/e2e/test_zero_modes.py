"""ZeRO modes beyond fp32 parity, through the training job's plain recipe on the 4-rank pool:
bf16 training (every strategy, ZeRO 1-3), ZeRO-Offload, and resuming a checkpoint at another
shape through DeepSpeed's universal checkpoint."""
import json

import pytest

from ds_seqpar.strategies.closed_form import Shapes, closed_form_bytes

from ..reference import K
from ..train_reference import reference_losses
from .test_train_e2e import REL, SHIPPED, TINY, _train, assert_close_losses, config_error_of, shipped_config

# ---------------------------------------------------------------------------------------------
# bf16
#
# Tolerance, derived as everywhere in the tests (reference.py): a bf16 run's largest relative
# deviation from the fp32 plain data-parallel run (losses, and separately gradient norms) may be
# at most K times that of plain data parallelism under the same DeepSpeed bf16 mode (sequence
# parallel size 1, the same global batch as 4 replicas of micro batch 1), plus a floor far below
# a bug. bf16 keeps 8 significant bits (u = 2^-8 = 3.9e-3): a lost P factor moves the norm by
# 50%, unsynchronised sequence ranks or bf16 attention merges move the losses by ~1e-2.

LOSS_FLOOR, NORM_FLOOR = 1e-6, 1e-5
_plain_bf16 = {}


def _bf16(ds, stage):
    ds["zero_optimization"]["stage"] = stage
    ds["bf16"] = {"enabled": True}
    return ds


def _deviation(results, ref):
    """(max relative loss deviation, max relative grad-norm deviation) of a run from ``ref``."""
    losses, norms = ref
    loss_dev = max(abs(g - w) / abs(w) for r in results for g, w in zip(r["losses"], losses[r["dp_rank"]]))
    norm_dev = max(abs(g - w) / abs(w) for r in results for g, w in zip(r["grad_norms"], norms))
    return loss_dev, norm_dev


def plain_bf16_deviation(pool, tmp_path, stage):
    """How far DeepSpeed's bf16 plain data parallelism (no sequence parallelism) lands from fp32."""
    if stage not in _plain_bf16:
        args = dict(TINY, sp_size=1, micro_batch=1, run_dir=str(tmp_path))
        ds = shipped_config("ulysses")
        results = pool.run(_train, dict(args, deepspeed_config=_bf16(ds, stage)))
        _plain_bf16[stage] = _deviation(results, reference_losses(dict(args, deepspeed_config=ds), 4))
    return _plain_bf16[stage]


def attention_bytes_per_step(name, ds, elem):
    """Closed-form bytes the busiest rank sends per step: every layer's attention, fwd + bwd."""
    sp = ds["sequence_parallel"]
    shapes = Shapes(ds["train_micro_batch_size_per_gpu"], TINY["seq_len"], TINY["n_heads"], TINY["n_kv_heads"],
                    TINY["dim"] // TINY["n_heads"], elem)
    return TINY["n_layers"] * closed_form_bytes(sp["strategy"], sp["size"], shapes, 0, sp.get("ulysses_size", 1))


@pytest.mark.parametrize("name", SHIPPED)
def test_bf16_training_stays_within_bf16_tolerance_of_fp32(pool, tmp_path, name):
    ref = None
    for stage in (1, 2, 3):
        ds = _bf16(shipped_config(name), stage)
        results = pool.run(_train, dict(TINY, deepspeed_config=ds, run_dir=str(tmp_path)))
        if ref is None:
            dp_size = len(results) // ds["sequence_parallel"]["size"]
            ref = reference_losses(dict(TINY, deepspeed_config=shipped_config(name)), dp_size)
        plain_loss, plain_norm = plain_bf16_deviation(pool, tmp_path, stage)
        loss_dev, norm_dev = _deviation(results, ref)
        what = f"{name} ZeRO-{stage} bf16"
        assert loss_dev <= K * plain_loss + LOSS_FLOOR, \
            f"{what}: losses deviate {loss_dev:.2e} from fp32, plain bf16 DP {plain_loss:.2e} (K={K})"
        assert norm_dev <= K * plain_norm + NORM_FLOOR, \
            f"{what}: grad norms deviate {norm_dev:.2e} from fp32, plain bf16 DP {plain_norm:.2e} (K={K})"
        # comm_dtype auto: q, k, v travel in bf16 (2 bytes), accumulators and LASP states in fp32
        with open(results[0]["metrics_path"]) as f:
            sent = [json.loads(line)["attn_comm_bytes"] for line in f]
        assert sent == [attention_bytes_per_step(name, ds, 2)] * TINY["steps"], (what, sent)


# ---------------------------------------------------------------------------------------------
# ZeRO-Offload


OFFLOAD = {"zero2-optimizer": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "zero3-optimizer-and-params": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                          "offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}}


def test_zero_offload_trains_with_sequence_parallelism_as_without(pool, tmp_path):
    """Optimizer states (and ZeRO-3 parameters) offloaded to the CPU: the losses and grad norms of plain data
    parallelism, which is what the runs without offload give too. The shipped configs' torch AdamW does the
    step on the offloaded fp32 partitions (DeepSpeed's offload path: gradients copied out to the CPU
    partitions, ZeRO-3's parameters fetched back per layer). DeepSpeedCPUAdam, DeepSpeed's default offload
    optimizer, is not used: it is a C++ op compiled on first use (most of a minute of this test on a fresh
    machine), and its arithmetic is DeepSpeed's, not the sequence-parallel path this checks."""
    ref_losses, ref_norms = reference_losses(dict(TINY, deepspeed_config=shipped_config("zigzag")), 2)
    for what, zero in OFFLOAD.items():
        ds = shipped_config("zigzag")
        assert ds["optimizer"]["params"]["torch_adam"], "the shipped config no longer picks torch's AdamW"
        ds["zero_optimization"].update(zero)
        results = pool.run(_train, dict(TINY, deepspeed_config=ds, run_dir=str(tmp_path)))
        for r in results:
            assert_close_losses(r["losses"], ref_losses[r["dp_rank"]], f"offload {what} rank {r['rank']}")
            assert_close_losses(r["grad_norms"], ref_norms, f"offload {what} rank {r['rank']}", 1e-4, "gradient norm")


# ---------------------------------------------------------------------------------------------
# resume at another shape (universal checkpoint)


def test_checkpoint_resumes_at_another_shape_through_the_universal_checkpoint(pool, pool2, tmp_path):
    """Saved after 2 steps at dp 2 x sp 2 (zigzag, ZeRO-2); resumed with --resume_universal at
    dp 1 x sp 2, dp 2 x sp 1 (2 ranks: the conftest's pool2) and with Ulysses (4 ranks), each with the
    same global batch of 4 sequences: steps 3-4 give the uninterrupted run's losses and norms.
    (Every label counts, so the mean over replicas is the global batch's mean at any shape.)"""
    base = dict(TINY, ignore_frac=0.0, steps=4, deepspeed_config=shipped_config("zigzag"),
                run_dir=str(tmp_path / "runs"))
    save = str(tmp_path / "ckpt")
    whole = pool.run(_train, base)[0]
    pool.run(_train, dict(base, steps=2, save_dir=save, save_interval=2))
    resumed = {"dp1 x sp2": pool2.run(_train, dict(base, micro_batch=4, **_resume(save)))[0],
               "dp2 x sp1": pool2.run(_train, dict(base, sp_size=1, **_resume(save)))[0],
               "ulysses": pool.run(_train, dict(base, strategy="ulysses", **_resume(save)))[0]}
    for shape, r in resumed.items():
        assert r["start_step"] == 2, (shape, r["start_step"])
        assert_close_losses(r["mean_losses"], whole["mean_losses"][2:], f"resumed at {shape}", REL)
        assert_close_losses(r["grad_norms"], whole["grad_norms"][2:], f"resumed at {shape}", 1e-4, "gradient norm")
    # deepspeed cannot load a ZeRO-2 checkpoint at ZeRO-3: said on every rank, before loading
    messages = pool.run(config_error_of, dict(base, zero_stage=3, **_resume(save)))
    assert len(set(messages)) == 1 and "saved with ZeRO stage 1 or 2" in messages[0], messages


def _resume(save_dir):
    return {"save_dir": save_dir, "resume_universal": True}
