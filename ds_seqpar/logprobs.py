"""Per-token log-probabilities and entropies of a sequence sharded across ranks, and the reductions that
post-training losses (DPO, GRPO, ...) build from them.

Every RL and preference loss is a function of per-token log p(label) under the policy (and an old policy, a
reference), summed or averaged per sequence or over the batch's tokens, plus the entropy. Under sequence
parallelism each rank holds the logits of its own tokens and, from ``sp.shard_batch``, their targets (labels
shifted over the whole sequence before the cut, none across a document boundary). So the per-token values
are local: no communication, no full [tokens, vocab] gather. Only the reductions talk, one all-reduce each,
over [batch] or [2] values.

Math per chunk of C rows (logits z already divided by the temperature T, target y, valid mask m):
    lse  = logsumexp(z)                    logp = z[y] - lse             H = -sum_k p_k log p_k,  p = exp(z - lse)
backward, with incoming gradients a = dL/dlogp and b = dL/dH (0 where a value is not asked for):
    dz_k = a (onehot_y - p_k) - b p_k (log p_k + H)        d logits = m * dz / T
The rows are processed ``chunk`` at a time, in fp32 (fp64 for fp64 inputs): the fp32 copy of the logits is
never larger than one chunk, and the fused head (``from_hidden``) never holds more than one chunk of logits
at all (the tiled head of memory/tiled_loss.py).

Reductions (``sequence_sums``, ``sequence_means``, ``token_mean``): the value is the unsharded one on every rank
of the sequence group; the all-reduce back-propagates as the identity, so each rank's gradient is its own
tokens' share and the sum over the group is the whole gradient (sp.loss's contract). ``grad_scale`` multiplies
that backward, as in sp.loss (P once DeepSpeed averages over data x sequence ranks: zero.py).

Legend: B = batch, L = local tokens, N = B * L, C = rows in a chunk, V = vocabulary, H = hidden.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .loss import _ScaleGrad
from .memory.tiled_loss import call_as_forward
from .ops import reduce
from .sharding.batch import IGNORE_INDEX

DEFAULT_CHUNK = 1024     # rows of fp32 logits at a time when neither the call nor the config names a chunk


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_forward(z_cv, target_c, valid_c, want_entropy: bool):
    """(logp [C], lse [C], entropy [C] or None) of tempered logits in the accumulation dtype. ``z_cv`` is a
    fresh tensor of this chunk and is overwritten (two [C, V] tensors at most: z, then p)."""
    lse_c = torch.logsumexp(z_cv, dim=-1)
    logp_c = torch.where(valid_c, z_cv.gather(1, target_c[:, None]).squeeze(1) - lse_c, 0.0)
    if not want_entropy:
        return logp_c, lse_c, None
    logp_cv = z_cv.sub_(lse_c[:, None])      # -sum p log p, not lse - sum p z: no cancellation at sharp z
    ent_c = -logp_cv.exp().mul_(logp_cv).sum(-1)
    return logp_c, lse_c, torch.where(valid_c, ent_c, 0.0)


def _chunk_backward(z_cv, target_c, valid_c, lse_c, ent_c, g_lp_c, g_ent_c, inv_t: float):
    """d logits [C, V] (before the temperature: the 1/T is applied here) for incoming gradients of logp and
    entropy (either may be None). ``z_cv`` is a fresh tensor of this chunk, overwritten and returned as the
    result: two [C, V] tensors at most (z -> log p -> dz, and p)."""
    logp_cv = z_cv.sub_(lse_c[:, None])
    p_cv = logp_cv.exp()
    a_c = g_lp_c if g_lp_c is not None else torch.zeros_like(lse_c)
    if g_ent_c is not None:      # -p (a + b (log p + H))
        dz_cv = logp_cv.add_(ent_c[:, None]).mul_(g_ent_c[:, None]).add_(a_c[:, None]).mul_(p_cv).neg_()
    else:                        # -p a
        dz_cv = p_cv.mul_(-a_c[:, None])
    rows = torch.arange(dz_cv.shape[0], device=dz_cv.device)
    dz_cv[rows, target_c] += a_c
    return dz_cv.mul_((valid_c.to(dz_cv.dtype) * inv_t)[:, None])


def _tempered(z_cv, acc: torch.dtype, inv_t: float):
    """A chunk's fresh logits (the head's output) in the accumulation dtype, divided by T, in place."""
    z_cv = z_cv.to(acc)
    return z_cv.mul_(inv_t) if inv_t != 1.0 else z_cv


def _targets(labels_n: torch.Tensor, ignore_index: int):
    valid_n = labels_n != ignore_index
    return torch.where(valid_n, labels_n, 0), valid_n


def _scan(chunk_logits, n: int, chunk: int, acc: torch.dtype, device, target_n, valid_n, want_entropy: bool):
    """(logp [N], lse [N], entropy [N] or [0]) over the rows ``chunk`` at a time; ``chunk_logits(rows)`` gives
    a fresh tempered [C, V] tensor of those rows (the logits' copy, or the head's matmul)."""
    logp_n = torch.empty(n, dtype=acc, device=device)
    lse_n = torch.empty(n, dtype=acc, device=device)
    ent_n = torch.zeros(n if want_entropy else 0, dtype=acc, device=device)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        lp, lse, ent = _chunk_forward(chunk_logits(rows), target_n[rows], valid_n[rows], want_entropy)
        logp_n[rows], lse_n[rows] = lp, lse
        if want_entropy:
            ent_n[rows] = ent
    return logp_n, lse_n, ent_n


def _chunk_grad(ctx, z_cv, rows, target_n, valid_n, lse_n, ent_n, g_lp_n, g_ent_n):
    """_chunk_backward for ``rows``, the incoming gradients sliced and cast to the accumulation dtype."""
    acc = lse_n.dtype
    return _chunk_backward(z_cv, target_n[rows], valid_n[rows], lse_n[rows],
                           ent_n[rows] if ctx.want_entropy else None,
                           None if g_lp_n is None else g_lp_n[rows].to(acc),
                           None if g_ent_n is None or not ctx.want_entropy else g_ent_n[rows].to(acc), ctx.inv_t)


class _LogitsLogprobs(torch.autograd.Function):
    """(logp [N], entropy [N]) of logits [N, V]; the fp32 view exists one chunk at a time."""

    @staticmethod
    def forward(ctx, logits_nv, target_n, valid_n, inv_t, chunk, want_entropy):
        acc = _acc(logits_nv.dtype)
        logp_n, lse_n, ent_n = _scan(lambda rows: _tempered(logits_nv[rows].to(acc, copy=True), acc, inv_t),
                                     logits_nv.shape[0], chunk, acc, logits_nv.device, target_n, valid_n,
                                     want_entropy)
        ctx.save_for_backward(logits_nv, target_n, valid_n, lse_n, ent_n)
        ctx.inv_t, ctx.chunk, ctx.want_entropy = inv_t, chunk, want_entropy
        return logp_n, ent_n

    @staticmethod
    def backward(ctx, g_lp_n, g_ent_n):
        logits_nv, target_n, valid_n, lse_n, ent_n = ctx.saved_tensors
        n, acc = logits_nv.shape[0], lse_n.dtype
        d_logits = torch.empty_like(logits_nv)
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            z_cv = _tempered(logits_nv[rows].to(acc, copy=True), acc, ctx.inv_t)
            d_logits[rows] = _chunk_grad(ctx, z_cv, rows, target_n, valid_n, lse_n, ent_n, g_lp_n,
                                         g_ent_n).to(logits_nv.dtype)
        return d_logits, None, None, None, None, None


class _HeadLogprobs(torch.autograd.Function):
    """(logp [N], entropy [N]) of ``hidden @ weight.T + bias``: the logits exist one chunk at a time, in the
    forward and again in the backward, which accumulates d_hidden, d_weight and d_bias from them."""

    @staticmethod
    def forward(ctx, hidden_nh, weight_vh, bias_v, target_n, valid_n, inv_t, chunk, want_entropy):
        acc = _acc(weight_vh.dtype)
        logp_n, lse_n, ent_n = _scan(
            lambda rows: _tempered(F.linear(hidden_nh[rows], weight_vh, bias_v), acc, inv_t), hidden_nh.shape[0],
            chunk, acc, hidden_nh.device, target_n, valid_n, want_entropy)
        ctx.save_for_backward(hidden_nh, weight_vh, bias_v, target_n, valid_n, lse_n, ent_n)
        ctx.inv_t, ctx.chunk, ctx.want_entropy = inv_t, chunk, want_entropy
        return logp_n, ent_n

    @staticmethod
    def backward(ctx, g_lp_n, g_ent_n):
        hidden_nh, weight_vh, bias_v, target_n, valid_n, lse_n, ent_n = ctx.saved_tensors
        n, acc = hidden_nh.shape[0], lse_n.dtype
        needs = ctx.needs_input_grad[:3]
        d_hidden = torch.empty_like(hidden_nh) if needs[0] else None
        d_weight = torch.zeros(weight_vh.shape, dtype=acc, device=weight_vh.device) if needs[1] else None
        d_bias = torch.zeros(bias_v.shape, dtype=acc, device=bias_v.device) if needs[2] else None
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            h_ch = hidden_nh[rows]
            z_cv = _tempered(F.linear(h_ch, weight_vh, bias_v), acc, ctx.inv_t)
            dz_cv = _chunk_grad(ctx, z_cv, rows, target_n, valid_n, lse_n, ent_n, g_lp_n, g_ent_n).to(weight_vh.dtype)
            if d_hidden is not None:
                d_hidden[rows] = dz_cv @ weight_vh
            if d_weight is not None:
                d_weight += (dz_cv.t() @ h_ch).to(acc)
            if d_bias is not None:
                d_bias += dz_cv.sum(0).to(acc)
        d_weight = d_weight.to(weight_vh.dtype) if d_weight is not None else None
        d_bias = d_bias.to(bias_v.dtype) if d_bias is not None else None
        return d_hidden, d_weight, d_bias, None, None, None, None, None


def _check_common(labels, temperature, chunk_tokens) -> None:
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be an integer tensor [batch, local_seq] (sp.shard_batch's), got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: log-probs are of softmax(logits / temperature), which needs a "
                         f"number > 0 (1.0: the model's own distribution)")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 0):
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a whole number >= 1 (or 0: all local tokens at once)")


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                   temperature: float = 1.0, entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK):
    """log softmax(logits / temperature)[label] per token, [batch, local_seq], 0 where the label is ignored;
    with ``entropy`` also the per-token entropy of that tempered distribution (0 where ignored). Local: no
    communication. fp32 results (fp64 for fp64 logits)."""
    _check_common(labels, temperature, chunk_tokens)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} plus a vocabulary dim; "
                         f"pass the labels returned by sp.shard_batch")
    target_n, valid_n = _targets(labels.reshape(-1), ignore_index)
    logits_nv = logits.reshape(-1, logits.shape[-1])
    chunk = chunk_tokens or max(1, logits_nv.shape[0])
    logp_n, ent_n = _LogitsLogprobs.apply(logits_nv, target_n, valid_n, 1.0 / float(temperature), chunk,
                                          bool(entropy))
    logp = logp_n.view(labels.shape)
    return (logp, ent_n.view(labels.shape)) if entropy else logp


def token_logprobs_from_hidden(hidden: torch.Tensor, lm_head: Union[nn.Module, torch.Tensor], labels: torch.Tensor,
                               bias: Optional[torch.Tensor] = None, ignore_index: int = IGNORE_INDEX,
                               temperature: float = 1.0, entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK):
    """token_logprobs(lm_head(hidden), labels, ...) without the [tokens, vocab] logits: at most
    ``chunk_tokens`` rows of them exist at a time, in the forward and in the backward. ``lm_head``: the head
    module (ZeRO-3 gathers its weight around the call) or its weight [vocab, hidden] with ``bias``."""
    _check_common(labels, temperature, chunk_tokens)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} plus a hidden dim; "
                         f"pass the labels returned by sp.shard_batch")

    def run(h, y, weight, b):
        if weight.dim() != 2 or weight.shape[1] != h.shape[-1]:
            raise ValueError(f"lm_head weight {tuple(weight.shape)} must be [vocab, hidden={h.shape[-1]}]"
                             + (" (under ZeRO-3 pass the head module, not its partitioned weight)"
                                if weight.numel() == 0 else ""))
        if b is not None and b.shape != weight.shape[:1]:
            raise ValueError(f"lm_head bias {tuple(b.shape)} must be [vocab={weight.shape[0]}]")
        target_n, valid_n = _targets(y.reshape(-1), ignore_index)
        h_nh = h.reshape(-1, h.shape[-1])
        chunk = chunk_tokens or max(1, h_nh.shape[0])
        return _HeadLogprobs.apply(h_nh, weight, b, target_n, valid_n, 1.0 / float(temperature), chunk,
                                   bool(entropy))

    if isinstance(lm_head, nn.Module):
        if bias is not None:
            raise ValueError("pass bias only with a weight tensor; a head module brings its own bias")
        head = lm_head
        logp_n, ent_n = call_as_forward(head, lambda h, y: run(h, y, head.weight, getattr(head, "bias", None)),
                                        hidden, labels)
    else:
        logp_n, ent_n = run(hidden, labels, lm_head, bias)
    logp = logp_n.view(labels.shape)
    return (logp, ent_n.view(labels.shape)) if entropy else logp


# -- reductions over the sequence group --------------------------------------------------------------------
def _check_values(values: torch.Tensor, mask: Optional[torch.Tensor], name: str) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or not values.is_floating_point():
        raise ValueError(f"{name}: values must be a floating-point tensor [batch, local_seq] (this rank's tokens, "
                         f"e.g. sp.token_logprobs), got {getattr(values, 'dtype', type(values).__name__)} "
                         f"{tuple(getattr(values, 'shape', ()))}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != values.shape):
        raise ValueError(f"{name}: mask must be a tensor shaped like values {tuple(values.shape)} (this rank's "
                         f"tokens, e.g. labels != -100), got {tuple(getattr(mask, 'shape', ()))}")


def _reduce(x: torch.Tensor, group, stats, kind: str, grad_scale: float) -> torch.Tensor:
    if grad_scale != 1.0:
        x = _ScaleGrad.apply(x, float(grad_scale))
    if group is None:
        return x
    return reduce.all_reduce_sum(x, group, stats, kind=kind)


def sequence_sums(values: torch.Tensor, mask: Optional[torch.Tensor] = None, group=None,
                  stats: Optional[comm.CommStats] = None, grad_scale: float = 1.0) -> torch.Tensor:
    """[batch]: each row's sum over the whole sequence (``mask``: only where it is nonzero), one all-reduce."""
    _check_values(values, mask, "sequence_sums")
    local = (values if mask is None else values * mask.to(values.dtype)).sum(-1)
    return _reduce(local.double(), group, stats, "seq_sum", grad_scale).to(values.dtype)


def sequence_means(values: torch.Tensor, mask: torch.Tensor, group=None, stats: Optional[comm.CommStats] = None,
                   grad_scale: float = 1.0) -> torch.Tensor:
    """[batch]: each row's mean over its masked tokens of the whole sequence (0 for a row with none); one
    all-reduce of [2, batch] (sums and counts, fp64: counts exact far past 2^24)."""
    _check_values(values, mask, "sequence_means")
    m = mask.to(values.dtype)
    pair = torch.stack([(values * m).sum(-1).double(), m.detach().sum(-1).double()])      # [2, B]
    pair = _reduce(pair, group, stats, "seq_mean", grad_scale)
    return (pair[0] / pair[1].clamp(min=1.0)).to(values.dtype)


def token_mean(values: torch.Tensor, mask: torch.Tensor, group=None, stats: Optional[comm.CommStats] = None,
               grad_scale: float = 1.0) -> torch.Tensor:
    """Scalar: the mean over every masked token of the whole batch and sequence (0 with none); one
    all-reduce of [2]."""
    _check_values(values, mask, "token_mean")
    m = mask.to(values.dtype)
    pair = torch.stack([(values * m).sum().double(), m.detach().sum().double()])          # [2]
    pair = _reduce(pair, group, stats, "token_mean", grad_scale)
    return (pair[0] / pair[1].clamp(min=1.0)).to(values.dtype)


__all__ = ["token_logprobs", "token_logprobs_from_hidden", "sequence_sums", "sequence_means", "token_mean",
           "DEFAULT_CHUNK"]
