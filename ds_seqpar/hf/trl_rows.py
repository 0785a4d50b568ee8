"""TRL trainers that score whole rows (DPOTrainer): the trainer sees whole rows, the model runs on shards.

TRL's preference trainers hand the model whole rows (``input_ids``, right-padded, ``labels`` = the completion's
tokens, -100 elsewhere) and read per-token fields back from its fused LM head (``log_probs``, ``entropy``,
``mean_logits``, ``is_top1``, ``log_sum_sq_probs``, ``label_mask``; TRL's ``add_fused_lm_head``), of width
``seq - 1``, from which they build per-sequence sums, their nonlinear losses (sigmoid, IPO, sorted AOT, ...) and
every metric. Under sequence parallelism the rows stay whole everywhere but inside the model:

  before the forward (a forward pre-hook that runs before the applied model's own, hooks.py): the call's row
    tensors go through ``sp.shard_batch`` (labels shifted over the whole row before the cut, so no target is lost
    at a shard edge, global position_ids), and the model gets this rank's tokens with the shifted targets as
    ``shift_labels`` (the fused head then scores them as they are); a right-padded attention_mask is dropped
    (exact for a causal model: no real token sees a later pad, the pads' targets are -100), any other mask refused;
  after it (a forward hook): each per-token field of this rank's tokens ([rows, local]) is unsharded (one
    all-gather of [rows, local] values per field, never logits) back to global order and cut to TRL's width
    ``seq - 1`` (target t+1 at position t, as TRL's own shift puts it), and the loss recomputed from the whole
    rows.

Every rank of a sequence group then holds the replica's whole per-token vectors, so TRL's code runs unchanged
and computes, on every rank, the values of plain data parallelism on the same rows: every loss type and every
metric. Gradients: each rank's loss is the same function of the gathered vectors, and the gather's backward
(a reduce-scatter) sums the group's P identical gradients onto each rank's own tokens: P x its share, which
DeepSpeed's average over data x sequence ranks (sp.mpu) turns into plain data parallelism's (zero.py).
TRL's metric gathers over the world would count each replica P times; the mixin replaces them by the
replicas' gather while the loss runs (trainer.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable

import torch

from .checks import UnsupportedModelError

ROW_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
SHARDED_KEYS = ("input_ids", "position_ids", "token_type_ids")     # [rows, seq] inputs that follow the tokens


class WholeRowScoring:
    """While active, fused-head calls of ``models`` take whole rows and give whole-row per-token fields."""

    def __init__(self, sp, trainer_name: str):
        self.sp, self.trainer_name = sp, trainer_name
        self.widths = []          # the running calls' row widths (a stack: a reference call may nest)

    @contextmanager
    def scoring(self, models: Iterable[torch.nn.Module]):
        handles = []
        try:
            for model in models:
                handles.append(model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
                handles.append(model.register_forward_hook(self._post, with_kwargs=True))
            yield self
        finally:
            for h in handles:
                h.remove()

    def _pre(self, module, args, kwargs):
        if args:
            raise UnsupportedModelError(f"ds_seqpar.hf: {self.trainer_name} called the model with positional "
                                        f"arguments; whole rows are sharded by keyword (input_ids=...)")
        if not kwargs.get("fused_lm_head"):
            raise UnsupportedModelError(f"ds_seqpar.hf: {self.trainer_name} asked for the logits of whole rows "
                                        f"(return_outputs / compute_metrics / predictions), which sequence "
                                        f"parallelism does not gather; evaluate with prediction_loss_only=True and "
                                        f"no compute_metrics (the loss and every logged metric are exact)")
        kwargs = dict(kwargs)
        ids, labels = kwargs.get("input_ids"), kwargs.pop("labels", None)
        if ids is None or labels is None or kwargs.get("shift_labels") is not None:
            raise UnsupportedModelError(f"ds_seqpar.hf: {self.trainer_name}'s fused-head call must give input_ids "
                                        f"and labels of whole rows (not shift_labels)")
        if kwargs.get("inputs_embeds") is not None or kwargs.get("pixel_values") is not None:
            raise UnsupportedModelError(f"ds_seqpar.hf: {self.trainer_name} with inputs_embeds or images is not "
                                        f"verified under sequence parallelism; pass text input_ids")
        drop_right_padding_mask(kwargs, self.trainer_name)
        width = ids.shape[1]
        batch = {k: kwargs.pop(k) for k in SHARDED_KEYS if kwargs.get(k) is not None}
        batch["labels"] = labels
        local = self.sp.shard_batch(batch)
        kwargs.update({k: local[k] for k in SHARDED_KEYS if k in local})
        kwargs["shift_labels"] = local["labels"]
        self.widths.append(width)
        return args, kwargs

    def _post(self, module, args, kwargs, output):
        width = self.widths.pop()
        fields = {}
        for name in ROW_FIELDS:
            value = getattr(output, name, None)
            fields[name] = None if value is None else self._whole(value, width)
        num_items = kwargs.get("num_items_in_batch")
        logp, mask = fields["log_probs"], fields["label_mask"]
        count = mask.sum().clamp(min=1) if num_items is None else num_items
        fields["loss"] = -logp.sum() / count
        fields["aux_loss"] = getattr(output, "aux_loss", None)
        return type(output)(**fields)

    def _whole(self, local: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, local] -> [rows, width - 1] in global order (target t+1 at position t)."""
        if local.dtype == torch.bool:
            full = self.sp.unshard(local.to(torch.int32).contiguous(), dim=1, seq_len=width) != 0
        else:
            full = self.sp.unshard(local.contiguous(), dim=1, seq_len=width)
        return full[:, :width - 1]


def drop_right_padding_mask(kwargs: dict, trainer_name: str) -> None:
    """A whole rows' attention_mask of ones or right padding -> removed (every rank sees the whole mask: the
    same decision everywhere, no collective); left or inner zeros refused."""
    mask = kwargs.pop("attention_mask", None)
    if mask is None or bool((mask != 0).all()):
        return
    if mask.dim() != 2 or bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise UnsupportedModelError(f"ds_seqpar.hf: {trainer_name} got rows with left or inner padding "
                                    f"(attention_mask zeros before real tokens), which cannot be exact under sequence "
                                    f"parallelism; pad on the right (TRL's preference collator does)")


__all__ = ["WholeRowScoring", "ROW_FIELDS", "drop_right_padding_mask"]
