"""TRL's SFTTrainer under the mixin (trainer.py): what SFTTrainer computes per micro-batch besides the
training loss, made the replica's.

The training loss needs nothing here: TRL's fused LM head scores the shards' ``shift_labels`` over
``num_items_in_batch`` (a local sum over the global count, as the Trainer's own loss). The rest is
computed by TRL per rank, and a rank holds only its shard of the replica's batch:
  * metrics (``entropy``, ``mean_token_accuracy``; ``num_tokens`` in training): TRL gathers per-rank
    sums with ``accelerator.gather_for_metrics`` over the world and divides. While SFTTrainer's
    compute_loss runs, that gather becomes: sum over the sequence group (the replica's sum), then
    gather over the replicas with accelerate's truncation of an epoch's last batch (keep the first
    ``remainder`` processes' values). The sums are then exactly those of plain data parallelism on the
    same replicas (size 1 with dp processes and the same micro batch);
  * ``num_tokens`` is counted by TRL on its inputs (the attention mask's ones, else the row width); the
    shards have neither the mask (dropped, right padding) nor the row's width (the layout pads it), so
    the count of the whole batch is taken before sharding (``TOKENS``) and TRL's increment replaced;
  * the eval loss: without ``num_items_in_batch`` (TRL's prediction_step passes none) TRL divides by the
    rank's own target count; the replica's loss is the group's summed sums over its summed counts.
A MoE router's auxiliary loss (a per-rank mean over the rank's tokens) is refused.
"""
from __future__ import annotations

import torch

from .. import comm
from ..errors import ConfigError

TOKENS = "_ds_seqpar_trl_num_tokens"      # carried from the sharding to compute_loss, never to the model


def is_trl(loss_owner: type) -> bool:
    """Whether ``loss_owner``, the class whose compute_loss the mixin's super() reaches, is TRL's SFTTrainer."""
    return loss_owner.__name__ == "SFTTrainer"


def refuse_inexact(trainer) -> None:
    if getattr(trainer, "aux_loss_enabled", False):
        raise ConfigError("ds_seqpar.hf: output_router_logits (TRL's MoE load-balancing loss) cannot be exact under "
                          "sequence parallelism (the router loss is a mean over each rank's own tokens); set "
                          "output_router_logits=False in the model config")


def tokens_of(batch) -> torch.Tensor:
    """What TRL adds to num_tokens for this (whole, unsharded) batch on one plain process."""
    mask, pos = batch.get("attention_mask"), batch.get("position_ids")
    if mask is not None:
        return mask.sum()
    if pos is not None:
        return torch.tensor(pos.size(1), device=pos.device)
    raise ConfigError("ds_seqpar.hf: TRL counts num_tokens from attention_mask or position_ids; the collator gave "
                      "neither (TRL's own collators give one)")


def compute_loss(trainer, parent, gather_replicas, model, inputs, *args, **kwargs):
    """SFTTrainer.compute_loss (``parent``) with its metric gathers made the replica's, and num_tokens
    counted on the whole batch. ``gather_replicas(tensor)``: one value per data-parallel replica, the
    last batch of an epoch truncated as accelerate truncates it (the mixin's evaluation gather)."""
    inputs = dict(inputs)
    tokens = inputs.pop(TOKENS, None)
    accelerator = trainer.accelerator
    before = getattr(trainer, "_total_train_tokens", 0)
    own = vars(accelerator).get("gather_for_metrics")
    accelerator.gather_for_metrics = lambda data, **_: _gather_replica_sum(trainer.sp, gather_replicas, data)
    try:
        out = parent(model, inputs, *args, **kwargs)
    finally:
        if own is None:
            del accelerator.gather_for_metrics
        else:
            accelerator.gather_for_metrics = own
    if trainer.model.training and tokens is not None:
        seen = int(gather_replicas(tokens.reshape(1).to(trainer.sp.device)).sum())
        trainer._total_train_tokens = before + seen // getattr(trainer, "_tp_size", 1)
        trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]
    return out


def _gather_replica_sum(sp, gather_replicas, data):
    """TRL gathers per-rank sums (scalars): the replica's sum, one value per replica, truncated at an
    epoch's last batch as accelerate truncates one value per process."""
    if not isinstance(data, torch.Tensor) or data.dim() != 0:
        raise ConfigError(f"ds_seqpar.hf: SFTTrainer gathered a {type(data).__name__} "
                          f"{tuple(getattr(data, 'shape', ()))} for its metrics; only per-rank sums (scalars) are "
                          f"known to be exact under sequence parallelism")
    total = comm.all_reduce(data.detach().reshape(1).clone(), sp.group, stats=sp.stats, kind="trl_metrics")
    return gather_replicas(total)


def eval_loss(loss: torch.Tensor, shard, sp) -> torch.Tensor:
    """TRL's eval loss on this rank is its shard's mean over its own targets (label_mask: shift_labels
    != -100, at least 1); the replica's is the group's sum of sums over the group's sum of counts."""
    count = (shard["shift_labels"] != -100).sum().to(torch.float64)
    pair = torch.stack([loss.detach().to(torch.float64) * count.clamp(min=1), count]).to(sp.device)
    total, targets = comm.all_reduce(pair, sp.group, stats=sp.stats, kind="eval_loss").tolist()
    return torch.tensor(total / max(targets, 1.0), dtype=loss.dtype, device=loss.device)

