"""What the Trainer mixin (trainer.py) refuses at construction, by name and before any collective: options
that cannot be exact under sequence parallelism, and Trainer subclasses whose own loss or evaluation is not
verified equal to plain data parallelism (the tables below say which are)."""
from __future__ import annotations

import torch

from ..config import ConfigError
from .trl_rollouts import ROLLOUT_TRAINERS


def _refuse_inexact(targs, kwargs) -> None:
    def refuse(option, why, fix):
        raise ConfigError(f"ds_seqpar.hf: {option} cannot be exact under sequence parallelism ({why}); {fix}")

    if getattr(targs, "label_smoothing_factor", 0.0):
        refuse(f"label_smoothing_factor={targs.label_smoothing_factor}", "the smoother shifts labels itself",
               "set label_smoothing_factor=0")
    if kwargs.get("compute_loss_func") is not None:
        refuse("a custom compute_loss_func", "it would see sharded logits and shift labels again",
               "use the model's loss (the default)")
    if getattr(targs, "average_tokens_across_devices", True) is False:
        refuse("average_tokens_across_devices=False", "each rank would normalise by its own shard's token count",
               "leave it True (the default)")
    dispatch = getattr(getattr(targs, "accelerator_config", None), "dispatch_batches", None)
    if dispatch:
        refuse("accelerator_config.dispatch_batches=True", "rank 0 reads and slices every batch by world rank",
               "set dispatch_batches=False")
    if dispatch is None and isinstance(kwargs.get("train_dataset"), torch.utils.data.IterableDataset):
        refuse("an IterableDataset with dispatch_batches unset (accelerate then dispatches)",
               "rank 0 reads and slices every batch by world rank", "pass accelerator_config={'dispatch_batches': "
               "False} (each process then iterates its own IterableDatasetShard)")
    if kwargs.get("model_init") is not None:
        refuse("model_init", "the model must exist when sequence parallelism is applied", "pass model=")


ROW_TRAINERS = ("DPOTrainer",) + ROLLOUT_TRAINERS   # TRL trainers whose model calls score whole rows (trl_rows.py)
VERIFIED_LOSSES = ("Trainer", "SFTTrainer") + ROW_TRAINERS   # compute_loss tested equal to plain dp
VERIFIED_EVAL = ("Trainer", "SFTTrainer", "DPOTrainer",      # prediction_step tested equal to plain dp
                 "Seq2SeqTrainer")                          # causal LMs; predict_with_generate: trainer_generate.py


def _refuse_unverified_loss(cls) -> None:
    """A Trainer subclass that computes the loss itself is refused by name unless its loss is one the
    tests show equal to plain data parallelism (transformers' Trainer; TRL's SFTTrainer, whose fused
    LM head scores the shards' shift_labels over num_items_in_batch; TRL's DPO, GRPO and RLOO trainers,
    whose rows are scored whole: trl_rows.py, trl_rollouts.py)."""
    owner = _owner(cls, "compute_loss")
    if owner.__name__ not in VERIFIED_LOSSES:
        raise ConfigError(f"ds_seqpar.hf: {owner.__name__} overrides compute_loss; sequence parallelism is verified "
                          f"equal to plain data parallelism with the losses of {', '.join(VERIFIED_LOSSES)} only; "
                          f"compute the loss through the model (model.loss_function) or use SequenceParallelTrainer")


def _refuse_unverified_eval(cls, targs, kwargs) -> None:
    """A subclass with its own prediction_step other than the verified ones (transformers' Trainer; TRL's
    SFTTrainer: trl_support makes its eval loss and metrics the replica's) is refused at construction
    when the run evaluates (an eval set or an eval strategy), not in the middle of training; ``evaluate()``
    on such a trainer is refused as well."""
    owner = _owner(cls, "prediction_step")
    strategy = getattr(getattr(targs, "eval_strategy", "no"), "value", getattr(targs, "eval_strategy", "no"))
    if owner.__name__ not in VERIFIED_EVAL and (kwargs.get("eval_dataset") is not None or strategy != "no"):
        raise ConfigError(f"ds_seqpar.hf: evaluation with {owner.__name__} (its own prediction_step) is not "
                          f"verified exact under sequence parallelism; pass no eval_dataset and eval_strategy='no', "
                          f"and evaluate with SequenceParallelTrainer or with size 1")


MIXIN_MARK = "_ds_seqpar_mixin"     # set on SequenceParallelMixin: true on the mixin and every class built on it


def _owner(cls, name):
    """The class whose ``name`` the mixin's super() reaches."""
    return next(c for c in cls.__mro__ if name in vars(c) and not getattr(c, MIXIN_MARK, False))


__all__ = ["ROW_TRAINERS", "VERIFIED_LOSSES", "VERIFIED_EVAL", "_refuse_inexact", "_refuse_unverified_loss",
           "_refuse_unverified_eval", "_owner"]
