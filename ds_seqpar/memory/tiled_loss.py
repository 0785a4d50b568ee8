"""LM head + cross-entropy fused over chunks of the local tokens: [tokens, vocab] is never held.

At long sequence the logits dominate a training step: tokens x vocab values (vocab 32k: 128 KB per
token in fp32), and as much again for their gradient. Here the head's matmul and the loss run over
``chunk_tokens`` rows at a time. The forward keeps each token's log-sum-exp (4 bytes) and no
logits; the backward recomputes one chunk's logits at a time and accumulates d_hidden, d_weight
and d_bias from them, returning them as ordinary gradients (one accumulation per parameter, so
DeepSpeed's gradient hooks fire once, as for nn.Linear).

Math per chunk (rows h of the hidden states, targets y, valid mask m):
    z   = h W^T + b                       logits in the weight's dtype, as nn.Linear computes them
    lse = logsumexp(float(z))             [C] fp32 (fp64 for fp64 weights), saved
    loss_sum += sum over valid rows of (lse - z[y])          = F.cross_entropy(reduction="sum")
backward, g = d(result) / d(loss_sum):
    dz = g * m * (exp(z - lse) - onehot(y))      dh = dz W     dW += dz^T h     db += sum_rows dz
The value then goes through loss.global_mean, so the result keeps sp.loss's contract.

Legend: N = local tokens (batch x local sequence, flattened), C = rows in one chunk, H = hidden,
V = vocabulary.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..loss import global_mean

_MISSING = object()


def _acc_dtype(weight_vh: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 weights (sp.loss's precision), fp64 for fp64 (references)."""
    return torch.promote_types(weight_vh.dtype, torch.float32)


def forward(hidden_nh, weight_vh, bias_v, target_n, valid_n, chunk: int):
    """(loss_sum scalar, lse_n [N]) without autograd; one chunk of logits at a time."""
    n, acc = hidden_nh.shape[0], _acc_dtype(weight_vh)
    lse_n = torch.empty(n, dtype=acc, device=hidden_nh.device)
    loss_sum = torch.zeros((), dtype=acc, device=hidden_nh.device)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        z_cv = F.linear(hidden_nh[rows], weight_vh, bias_v).to(acc)              # [C, V]
        lse_c = torch.logsumexp(z_cv, dim=-1)                                    # [C]
        picked_c = z_cv.gather(1, target_n[rows, None]).squeeze(1)               # [C]
        loss_sum += torch.where(valid_n[rows], lse_c - picked_c, 0.0).sum()
        lse_n[rows] = lse_c
    return loss_sum, lse_n


def backward(grad, hidden_nh, weight_vh, bias_v, target_n, valid_n, lse_n, chunk: int, needs: Tuple[bool, ...]):
    """(d_hidden, d_weight, d_bias) for d(result)/d(loss_sum) = ``grad``; None where not needed.
    d_weight and d_bias accumulate in fp32 (at least) over the chunks, then take the weight's dtype."""
    n, acc = hidden_nh.shape[0], _acc_dtype(weight_vh)
    d_hidden = torch.empty_like(hidden_nh) if needs[0] else None
    d_weight = torch.zeros(weight_vh.shape, dtype=acc, device=weight_vh.device) if needs[1] else None
    d_bias = torch.zeros(bias_v.shape, dtype=acc, device=bias_v.device) if needs[2] else None
    g = grad.to(acc)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        h_ch = hidden_nh[rows]
        p_cv = F.linear(h_ch, weight_vh, bias_v).to(acc).sub_(lse_n[rows, None]).exp_()      # softmax [C, V]
        p_cv[torch.arange(p_cv.shape[0], device=p_cv.device), target_n[rows]] -= 1.0
        dz_cv = p_cv.mul_((valid_n[rows] * g)[:, None]).to(weight_vh.dtype)                  # [C, V]
        if d_hidden is not None:
            torch.mm(dz_cv, weight_vh, out=d_hidden[rows])                                   # [C, H]
        if d_weight is not None and d_weight.dtype == dz_cv.dtype:
            d_weight.addmm_(dz_cv.t(), h_ch)                                                 # [V, H], in place
        elif d_weight is not None:
            d_weight.add_(dz_cv.t() @ h_ch)
        if d_bias is not None:
            d_bias.add_(dz_cv.sum(0))
    d_weight = d_weight.to(weight_vh.dtype) if d_weight is not None else None
    d_bias = d_bias.to(bias_v.dtype) if d_bias is not None else None
    return d_hidden, d_weight, d_bias


class FusedHeadLoss(torch.autograd.Function):
    """Sum of the token losses of ``hidden_nh @ weight_vh.T + bias_v`` against ``target_n``."""

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, target_n, valid_n, chunk):
        loss_sum, lse_n = forward(hidden_nh, weight_vh, bias_v, target_n, valid_n, chunk)
        ctx.save_for_backward(hidden_nh, weight_vh, bias_v, target_n, valid_n, lse_n)
        ctx.chunk = chunk
        return loss_sum

    @staticmethod
    def backward(ctx, grad):
        hidden_nh, weight_vh, bias_v, target_n, valid_n, lse_n = ctx.saved_tensors
        grads = backward(grad, hidden_nh, weight_vh, bias_v, target_n, valid_n, lse_n, ctx.chunk,
                         ctx.needs_input_grad[:3])
        return (*grads, None, None, None)


def fused_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, chunk_tokens: int = 0, ignore_index: int = -100):
    """(sum of this rank's token losses, number of valid tokens) from hidden states [..., H] and the
    head's weight [V, H]; ``chunk_tokens`` rows of logits at a time (0: all local tokens at once)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} plus a hidden dim; "
                         f"pass the labels returned by sp.shard_batch")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"lm_head weight {tuple(weight.shape)} must be [vocab, hidden={hidden.shape[-1]}]"
                         + (" (under ZeRO-3 pass the head module, not its partitioned weight)" if weight.numel() == 0
                            else ""))
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"lm_head bias {tuple(bias.shape)} must be [vocab={weight.shape[0]}]")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 (or 0: all local tokens in one chunk)")
    hidden_nh = hidden.reshape(-1, hidden.shape[-1])
    labels_n = labels.reshape(-1)
    valid_n = labels_n != ignore_index
    target_n = torch.where(valid_n, labels_n, 0)
    chunk = chunk_tokens or max(1, hidden_nh.shape[0])
    loss_sum = FusedHeadLoss.apply(hidden_nh, weight, bias, target_n, valid_n, chunk)
    return loss_sum, valid_n.sum()


def call_as_forward(module: nn.Module, fn, *args):
    """Run ``fn(*args)`` as ``module``'s forward, so the module's hooks wrap it as they wrap its own
    forward: ZeRO-3 gathers the module's parameters for this forward and again for its backward."""
    saved = module.__dict__.get("forward", _MISSING)
    module.forward = fn
    try:
        return module(*args)
    finally:
        if saved is _MISSING:
            del module.forward
        else:
            module.forward = saved


def sequence_loss_from_hidden(hidden: torch.Tensor, lm_head: Union[nn.Module, torch.Tensor], labels: torch.Tensor,
                              group=None, bias: Optional[torch.Tensor] = None, chunk_tokens: int = 0,
                              ignore_index: int = -100, stats: Optional[comm.CommStats] = None,
                              grad_scale: float = 1.0) -> torch.Tensor:
    """sequence_loss(lm_head(hidden), labels) without the logits tensor: same value, same gradients.

    ``lm_head``: the head module (nn.Linear or anything with ``weight`` [V, H] and optional ``bias``;
    the computation then runs inside the module's call, which ZeRO-3 needs) or its weight tensor."""
    if isinstance(lm_head, nn.Module):
        if bias is not None:
            raise ValueError("pass bias only with a weight tensor; a head module brings its own bias")
        head = lm_head
        loss_sum, count = call_as_forward(
            head, lambda h, y: fused_loss_sum(h, head.weight, y, getattr(head, "bias", None), chunk_tokens,
                                              ignore_index), hidden, labels)
    else:
        loss_sum, count = fused_loss_sum(hidden, lm_head, labels, bias, chunk_tokens, ignore_index)
    return global_mean(loss_sum, count, group, stats, grad_scale)


__all__ = ["FusedHeadLoss", "fused_loss_sum", "sequence_loss_from_hidden", "call_as_forward"]
