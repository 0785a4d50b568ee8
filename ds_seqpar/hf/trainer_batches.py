"""The Trainer mixin's checks of one batch and of the DeepSpeed batch keys (trainer.py calls them): every rank of a
sequence group holds the same batch, right padding is dropped (anything else refused), and the world-sized
train_batch_size transformers fills is made the replicas'."""
from __future__ import annotations

import torch

from .. import comm
from ..config import ConfigError


def replica_batch_size(ds: dict, world: int, size: int, micro: int, accumulation: int) -> None:
    """transformers fills ``train_batch_size`` ("auto") with world x micro x accumulation and refuses any
    other literal at train(); with ``size`` ranks per replica the global batch is (world / size) x micro x
    accumulation. The world value (HF's fill, or that literal) is removed from ``ds``: DeepSpeed derives
    the replica value from the mpu. Any other value is refused here, with the fix."""
    filled = ds.get("train_batch_size")
    if filled is None:
        return
    if filled == world * micro * accumulation:
        del ds["train_batch_size"]
        return
    replicas = world // size
    raise ConfigError(f"train_batch_size={filled}: transformers requires world x micro batch x accumulation = "
                      f"{world} x {micro} x {accumulation} = {world * micro * accumulation} (it refuses another "
                      f"value at train()); with sequence_parallel.size={size} the {replicas} data-parallel "
                      f"replicas' batch is {replicas * micro * accumulation}, which ds_seqpar hands DeepSpeed "
                      f"itself: set train_batch_size to 'auto' or remove it")


def check_group_batch(batch, sp) -> None:
    """Every rank of the sequence group holds the same batch: one all-reduce (max of h and -h) of a
    fingerprint of input_ids; a group that disagrees stops the run on every rank."""
    ids = batch.get("input_ids")
    if ids is None:
        raise ConfigError("ds_seqpar.hf: the batch has no input_ids")
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64) % 1_000_003
    h = int((ids.reshape(-1).to(torch.int64).cpu() * weights).sum()) % (1 << 61) + ids.shape[1] * 1_000_033
    if not group_agrees(h, sp):
        raise ConfigError("ds_seqpar.hf: the ranks of one sequence group got different batches (a loader sharded per "
                          "world rank, or a random collator seeded per rank); every rank of a group must read the "
                          "same batch")


def group_agrees(h: int, sp) -> bool:
    """Whether every rank of the sequence group holds the same fingerprint ``h``: one all-reduce (max of h, -h)."""
    pair = torch.tensor([h, -h], dtype=torch.int64, device=sp.device)
    high, neg_low = comm.all_reduce(pair, sp.group, op="max", stats=sp.stats, kind="batch_check").tolist()
    return high == -neg_low


def drop_right_padding(batch) -> None:
    """A mask of ones, or right padding (every row ones then zeros) -> removed; anything else refused."""
    mask = batch.pop("attention_mask", None)
    if mask is None or bool((mask != 0).all()):
        return
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ConfigError("ds_seqpar.hf: a batch with left or inner padding (attention_mask zeros before real tokens) "
                          "cannot be exact under sequence parallelism; pad on the right (padding_side='right') or "
                          "pack the samples (DataCollatorWithFlattening)")


__all__ = ["check_group_batch", "drop_right_padding", "group_agrees", "replica_batch_size"]
