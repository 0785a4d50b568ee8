"""Cross-entropy over a sequence sharded across ranks: the mean over every non-ignored token of
the whole sequence, identical on every rank of the sequence group.

Backward: rank r's loss is

    L = (sum_r s_r) / C        s_r = sum of this rank's token losses, C = global valid count

and dL/d(logits_r) = (d s_r / d logits_r) / C: exactly the gradient of this rank's share. The
all-reduce of s_r therefore back-propagates as the identity (ops/reduce.py, opaque to torch.compile), and the sum of
the P ranks' gradients is the full-sequence gradient of L. Under DeepSpeed, which averages over
all data x sequence ranks at every ZeRO stage, ``grad_scale`` = P turns that average into plain
data parallelism's (zero.py); it multiplies the backward only, never the value.

Legend: B = batch, L = local tokens, V = vocabulary.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import comm
from .ops import reduce
from .sharding.batch import IGNORE_INDEX


class _ScaleGrad(torch.autograd.Function):
    """Identity forward (bit-exact value); gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def local_loss_sum(logits_blv: torch.Tensor, labels_bl: torch.Tensor, ignore_index: int = IGNORE_INDEX):
    """(sum of token losses, number of valid tokens) of this rank's shard; fp32 math."""
    if logits_blv.shape[:-1] != labels_bl.shape:
        raise ValueError(f"logits {tuple(logits_blv.shape)} must be labels {tuple(labels_bl.shape)} plus a "
                         f"vocabulary dim; pass the labels returned by sp.shard_batch")
    logits_nv = logits_blv.reshape(-1, logits_blv.shape[-1]).float()        # [B*L, V]
    labels_n = labels_bl.reshape(-1)                                        # [B*L]
    loss_sum = F.cross_entropy(logits_nv, labels_n, ignore_index=ignore_index, reduction="sum")
    count = (labels_n != ignore_index).sum()
    return loss_sum, count


def sequence_loss(logits_blv: torch.Tensor, labels_bl: torch.Tensor, group=None,
                  ignore_index: int = IGNORE_INDEX, stats: Optional[comm.CommStats] = None,
                  grad_scale: float = 1.0) -> torch.Tensor:
    """Mean token loss over the whole sequence held by ``group`` (None: this process alone).

    One all-reduce of [loss_sum, count] in fp64 (counts stay exact far past 2^24 tokens). A
    batch with no valid token gives 0 with zero gradients instead of 0/0 = NaN.
    """
    loss_sum, count = local_loss_sum(logits_blv, labels_bl, ignore_index)
    return global_mean(loss_sum, count, group, stats, grad_scale)


def global_mean(loss_sum: torch.Tensor, count: torch.Tensor, group=None, stats: Optional[comm.CommStats] = None,
                grad_scale: float = 1.0) -> torch.Tensor:
    """(this rank's loss sum, valid count) -> the sequence group's mean, with the backward above.
    Shared by sequence_loss and the fused head + loss (memory/tiled_loss.py)."""
    if grad_scale != 1.0:
        loss_sum = _ScaleGrad.apply(loss_sum, float(grad_scale))
    pair = torch.stack([loss_sum.double(), count.detach().double()])        # [2]
    if group is not None:
        pair = reduce.all_reduce_sum(pair, group, stats, kind="loss")
    return (pair[0] / pair[1].clamp(min=1.0)).to(loss_sum.dtype)


__all__ = ["sequence_loss", "local_loss_sum", "global_mean"]
