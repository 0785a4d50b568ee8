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
    all-gather of [rows, local] values per field, never logits) back to global order, rotated back, and cut to
    TRL's width ``seq - 1`` (target t+1 at position t, as TRL's own shift puts it), and the loss recomputed from
    the whole rows. Values at padded positions (whose targets are -100 and which TRL masks) are not the plain
    model's: they are never read unmasked.

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
from typing import Iterable, Optional

import torch

from .checks import UnsupportedModelError

ROW_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
TRL_TILE = "_CHUNKED_LOGPROB_CHUNK_SIZE"     # trl.trainer.utils: rows of logits TRL's fused head computes at once
SHARDED_KEYS = ("input_ids", "position_ids", "token_type_ids")     # [rows, seq] inputs that follow the tokens


class WholeRowScoring:
    """While active, fused-head calls of ``models`` take whole rows and give whole-row per-token fields."""

    def __init__(self, sp, trainer_name: str):
        self.sp, self.trainer_name = sp, trainer_name
        self.calls = []           # the running calls' (row width, rows' left padding) (a stack: a call may nest)
        self.pause = 0

    @contextmanager
    def paused(self):
        """The models' calls pass untouched meanwhile (a rollout generating on whole prompts)."""
        self.pause += 1
        try:
            yield
        finally:
            self.pause -= 1

    @contextmanager
    def scoring(self, models: Iterable[torch.nn.Module]):
        """While active: the models' fused-head calls sharded, and TRL's fused head tiled by sp's chunk (its own
        tile is 32768 rows: at long context that many rows of fp32 logits per rank)."""
        import trl.trainer.utils as trl_utils
        handles, tile = [], getattr(trl_utils, TRL_TILE, None)
        if tile is not None:
            setattr(trl_utils, TRL_TILE, self.sp.logprob_chunk())
        try:
            for model in models:
                handles.append(model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
                handles.append(model.register_forward_hook(self._post, with_kwargs=True))
            yield self
        finally:
            if tile is not None:
                setattr(trl_utils, TRL_TILE, tile)
            for h in handles:
                h.remove()

    def _pre(self, module, args, kwargs):
        if self.pause:
            return None
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
        lead = align_rows(kwargs, labels, self.trainer_name)
        width = ids.shape[1]
        batch = {k: kwargs.pop(k) for k in SHARDED_KEYS if kwargs.get(k) is not None}
        batch["labels"] = labels
        if lead is not None:
            batch = {k: rotate(v, lead) for k, v in batch.items()}
            batch["position_ids"] = kept_positions(lead, width)
        local = self.sp.shard_batch(batch)
        kwargs.update({k: local[k] for k in SHARDED_KEYS if k in local})
        kwargs["shift_labels"] = local["labels"]
        self.calls.append((width, lead))
        return args, kwargs

    def _post(self, module, args, kwargs, output):
        if self.pause:
            return None
        width, lead = self.calls.pop()
        fields = {}
        for name in ROW_FIELDS:
            value = getattr(output, name, None)
            fields[name] = None if value is None else self._whole(value, width, lead)
        num_items = kwargs.get("num_items_in_batch")
        logp, mask = fields["log_probs"], fields["label_mask"]
        count = mask.sum().clamp(min=1) if num_items is None else num_items
        fields["loss"] = -logp.sum() / count
        fields["aux_loss"] = getattr(output, "aux_loss", None)
        return type(output)(**fields)

    def _whole(self, local: torch.Tensor, width: int, lead) -> torch.Tensor:
        """[rows, local] -> [rows, width - 1] in global order (target t+1 at position t)."""
        if local.dtype == torch.bool:
            full = self.sp.unshard(local.to(torch.int32).contiguous(), dim=1, seq_len=width) != 0
        else:
            full = self.sp.unshard(local.contiguous(), dim=1, seq_len=width)
        if lead is not None:
            full = rotate(full, -lead)
        return full[:, :width - 1]


def align_rows(kwargs: dict, labels: torch.Tensor, trainer_name: str) -> Optional[torch.Tensor]:
    """A whole rows' attention_mask removed; returns each row's left padding (None: none anywhere). Every rank
    sees the whole mask: the same decision everywhere, no collective. A row must be zeros, ones, zeros (left
    padding, real tokens, right padding); inner zeros are refused, as are position_ids given with left padding
    (the rotation keeps the plain model's positions, 0 .. N-1 over the padded row, which such a call replaces)."""
    mask = kwargs.pop("attention_mask", None)
    if mask is None or bool((mask != 0).all()):
        return None
    real = mask != 0
    if mask.dim() != 2:
        raise UnsupportedModelError(f"ds_seqpar.hf: {trainer_name} passed a {mask.dim()}-D attention_mask; whole "
                                    f"rows take a [rows, seq] mask of ones and padding zeros")
    lead = (real.cumsum(1) == 0).sum(1)
    rotated = rotate(real.to(torch.int8), lead)
    if bool((rotated[:, 1:] > rotated[:, :-1]).any()):
        raise UnsupportedModelError(f"ds_seqpar.hf: {trainer_name} got rows with inner padding (attention_mask "
                                    f"zeros between real tokens), which cannot be exact under sequence parallelism; "
                                    f"pad rows on the left or right only")
    if not bool(lead.any()):
        return None
    if kwargs.get("position_ids") is not None:
        raise UnsupportedModelError(f"ds_seqpar.hf: {trainer_name} passed position_ids with left-padded rows; "
                                    f"pass the mask alone (the plain model then counts positions over the padded "
                                    f"row, as the rotation keeps them) or pad on the right")
    first = labels.gather(1, lead.clamp(max=labels.shape[1] - 1)[:, None])[:, 0]
    if bool(((lead > 0) & (first != -100)).any()):
        raise UnsupportedModelError(f"ds_seqpar.hf: {trainer_name} gave a target to a row's first real token after "
                                    f"left padding (predicted by a pad in the plain model); label it -100")
    return lead


def rotate(rows: torch.Tensor, lead: torch.Tensor) -> torch.Tensor:
    """Row b rotated left by lead[b] along dim 1 (right by -lead[b]): out[b, t] = rows[b, (t + lead[b]) % N]."""
    n = rows.shape[1]
    index = (torch.arange(n, device=rows.device)[None] + lead.to(rows.device)[:, None]) % n
    return rows.gather(1, index.view(*index.shape, *([1] * (rows.dim() - 2))).expand_as(rows))


def kept_positions(lead: torch.Tensor, width: int) -> torch.Tensor:
    """A rotated row's position ids: each real token keeps its plain one (its index in the padded row), the pads
    rotated to the end count on: the global token index plus the row's lead, a constant offset per row
    (hf/batch_check.py: exact as it is, no document boundary)."""
    return torch.arange(width, device=lead.device)[None] + lead[:, None]


__all__ = ["WholeRowScoring", "ROW_FIELDS", "align_rows", "rotate", "kept_positions"]
