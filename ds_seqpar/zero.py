"""How sp.loss's backward meets DeepSpeed's gradient reduction, at every ZeRO stage (deepspeed 0.19).

The mpu (topology.py) shows DeepSpeed plain data parallelism over all W = dp x P ranks. DeepSpeed
then AVERAGES the W ranks' gradients at every stage and on every path (stage 0-2 all-reduce and
reduce-scatter buckets, stage 3's reduce-scatter and its contiguous buckets, with or without
offload, in any precision). sp.loss's backward gives each of the P ranks of a sequence its share
of that sequence's loss gradient, the shares summing to the whole gradient g_d of replica d, so
with every share multiplied by P:

    (1/W) * sum_d sum_r P * share_{d,r} = (1/dp) * sum_d g_d

exactly plain data parallelism's mean over replicas, and clipping, accumulation and the grad norm
DeepSpeed reports are then those of plain data parallelism too.

The factor applies once DeepSpeed reduces this run's gradients, which the mpu learns when
DeepSpeed asks it for the group to reduce over (``deepspeed.initialize(mpu=sp.mpu)`` does,
before the first step). Without DeepSpeed the factor is 1: the sum of the P ranks' gradients is
the whole-sequence gradient, sp.loss's documented contract. So SequenceParallel(cfg) and
SequenceParallel.from_ds_config behave alike, whatever the ZeRO stage and however the model was
built (plain, or under zero.Init over the world or the sequence x data group).

Refused, because DeepSpeed would not take its groups from the mpu: a DeepSpeed config with both
``data_parallel_size`` and ``sequence_parallel_size`` (deepspeed.initialize then builds a device
mesh and reduces over it). And train_batch_size counts replicas, not ranks: the P ranks of a
sequence share its samples (``check_batch_size``).
"""
from __future__ import annotations

from typing import Any, Mapping

from .config import ConfigError


def loss_grad_scale(mpu) -> float:
    """The factor sp.loss's backward needs now: P once DeepSpeed reduces with ``mpu``, else 1."""
    if not mpu.handed_to_deepspeed or mpu.sequence_size == 1:
        return 1.0
    _check_no_mesh()
    return float(mpu.sequence_size)


def _check_no_mesh() -> None:
    from deepspeed.utils import groups
    if getattr(groups, "mesh_device", None) is not None:
        raise ConfigError(_MESH_MESSAGE)


_MESH_MESSAGE = ("the DeepSpeed config has both data_parallel_size and sequence_parallel_size, so "
                 "deepspeed.initialize built a device mesh and reduces gradients over it instead of over "
                 "sp.mpu's groups (the loss would be scaled wrongly); remove data_parallel_size (the "
                 "replica count follows from the world size and sequence_parallel.size)")


def check_ds_config(ds_config: Mapping[str, Any], sp_size: int, dp_size: int) -> None:
    """What DeepSpeed would do wrong, or refuse confusingly, with this sequence-parallel layout:
    said before any communication, the same on every rank."""
    if sp_size > 1 and "data_parallel_size" in ds_config and "sequence_parallel_size" in ds_config:
        raise ConfigError(_MESH_MESSAGE)
    check_batch_size(ds_config, sp_size, dp_size)


def check_batch_size(ds_config: Mapping[str, Any], sp_size: int, dp_size: int) -> None:
    """train_batch_size = micro batch x accumulation x REPLICAS (world / sequence_parallel.size):
    the ranks of one sequence share its samples. DeepSpeed asserts the same through the mpu, with
    a message that says world_size; this one says what to change."""
    batch, micro = ds_config.get("train_batch_size"), ds_config.get("train_micro_batch_size_per_gpu")
    accum = ds_config.get("gradient_accumulation_steps")
    if not isinstance(batch, int) or sp_size == 1:
        return                      # absent or "auto": DeepSpeed derives it from the replicas
    if isinstance(micro, int) and isinstance(accum, int):
        want = micro * accum * dp_size
    elif isinstance(micro, int) or isinstance(accum, int):
        known = micro if isinstance(micro, int) else accum
        want = batch if batch % (known * dp_size) == 0 else known * dp_size
    else:
        want = batch if batch % dp_size == 0 else dp_size
    if batch != want:
        raise ConfigError(
            f"train_batch_size={batch} does not fit {dp_size} data-parallel replicas (world {dp_size * sp_size} "
            f"/ sequence_parallel.size={sp_size}; the {sp_size} ranks of a sequence share its samples, so "
            f"train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x {dp_size}, "
            f"e.g. {want}); set it to that or leave it out")


__all__ = ["check_batch_size", "check_ds_config", "loss_grad_scale"]
