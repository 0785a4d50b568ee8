"""What DeepSpeed's ZeRO needs from a sequence-parallel run beyond ``mpu=sp.mpu`` (deepspeed 0.19).

Stages 0-2 reduce gradients over the sequence x data group, summing over the P sequence ranks
and averaging over replicas: sp.loss's backward is then right as it is.

Stage 3 differs in two ways, both checked by tests/test_train_e2e.py against plain data
parallelism:
  * a model not built under ``zero.Init`` is partitioned by ``deepspeed.initialize`` over
    ``mpu.get_data_parallel_group()``, the replicas of ONE sequence shard: gradients are then never
    combined across sequence ranks and their weights silently drift apart. ``partition_for_zero3``
    partitions the model over the sequence x data group first, so initialize keeps that.
  * its reduce-scatter averages over all P x dp ranks (no P compensation): sp.loss needs
    ``grad_scale=P`` (``deepspeed_grad_scale``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .config import ConfigError


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def deepspeed_grad_scale(ds_config: Mapping[str, Any], sp_size: int) -> float:
    """Factor for sp.loss's backward so DeepSpeed's reduction yields plain data-parallel gradients.

    Stage 3 without reduce_scatter reduces small buckets with the P compensation and oversized
    ones without it, which no single factor fixes: refused, before anything starts."""
    if zero_stage(ds_config) != 3 or sp_size == 1:
        return 1.0
    if not ds_config["zero_optimization"].get("reduce_scatter", True):
        raise ConfigError(f"zero_optimization.reduce_scatter=false with ZeRO stage 3 and "
                          f"sequence_parallel.size={sp_size}: DeepSpeed then scales some gradient buckets for "
                          f"sequence parallelism and not others; remove reduce_scatter (default true) or use "
                          f"ZeRO stage 1 or 2")
    return float(sp_size)


def partition_for_zero3(model: torch.nn.Module, ds_config: Mapping[str, Any], sp) -> torch.nn.Module:
    """Stage 3: partition ``model`` (built and initialised normally, on every rank alike) over the
    sequence x data group, as zero.Init would have. Other stages: unchanged."""
    if zero_stage(ds_config) != 3:
        return model
    import deepspeed
    deepspeed.zero.Init(module=model, data_parallel_group=sp.mpu.get_sequence_data_parallel_group(),
                        config_dict_or_path=dict(ds_config), mpu=sp.mpu)
    return model


__all__ = ["deepspeed_grad_scale", "partition_for_zero3", "zero_stage"]
