"""Ulysses: all-to-all from sequence-sharded to head-sharded, full-sequence attention, and back.

Notation: P ranks in the Ulysses group, S_local tokens per rank, H q heads, H_kv k/v heads.

    q_bshd [b, S_local, H, d] --all_to_all(heads -> seq)--> [b, P*S_local, H/P, d]
    local kernel over the whole sequence (this rank's H/P heads)
    out    [b, P*S_local, H/P, d] --all_to_all(seq -> heads)--> [b, S_local, H, d]

Backward is the same exchanges in reverse (each all-to-all's dual): dout goes heads-sharded, the
kernel's backward runs on the saved head-sharded q, k, v, out, lse, and dq, dk, dv come back
sequence-sharded. ``head_parallel_forward`` / ``_backward`` are that sandwich around any inner
attention (the kernel here; the ring loop in the 2D hybrid, hybrid.py).

GQA: K/V travel with their own H_kv heads. When P does not divide H_kv, each k/v head is
repeated the least number of times f = P / gcd(H_kv, P) that makes H_kv*f split over P ranks;
backward sums the copies' gradients back (``_sum_copies``). Rank r then holds q heads
[r*H/P, (r+1)*H/P) and exactly the k/v heads they use.

Bytes per rank, one forward + backward, element size e: q, k, v, out forward and dout, dq, dk,
dv backward, each sending (P-1)/P of its local tensor: 8*e*S*(P-1)/P for MHA, where S is the
number of elements of one local full-head tensor.

Packed documents (cu_seqlens) and sliding windows: after the all-to-all every rank holds the whole
sequence, so local attention follows the mask's plan over one position (mask_plan.py: a causal band
per document, a window's band; end padding pairs with nothing) through the ring loop's single step;
the bytes are unchanged. Softcap goes to the
kernel; sinks join the final merge (ring_loop.apply_sinks_), each rank with its heads' sinks
(``local_heads``): its sink gradient is its heads' share, the others' rows are zero.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from .. import comm
from ..kernels import acc_dtype
from ..kernels.base import check_head_groups
from ..masks import Mask
from ..sharding.layouts import make_layout
from .base import Strategy
from .mask_plan import PlanCache, plain_blocks, plan_mask
from .ring_loop import ring_forward, ring_grads


def kv_replication(num_heads: int, num_kv_heads: int, size: int) -> int:
    """Least repeat factor of each k/v head so the k/v heads split evenly over ``size`` ranks."""
    return size // math.gcd(num_kv_heads, size)


def check_ulysses_heads(num_heads: int, num_kv_heads: int, size: int, key: str) -> None:
    if num_heads % size:
        valid = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(f"{key}={size}: Ulysses splits attention heads over ranks, and {num_heads} q heads "
                         f"are not divisible by {size}; use a {key} that divides {num_heads} "
                         f"({', '.join(map(str, valid))}) or a ring strategy (ring, zigzag, striped)")
    check_head_groups(num_heads, num_kv_heads)


def seq_to_heads(x_bshd: torch.Tensor, group, stats, kind="all_to_all") -> torch.Tensor:
    """[b, S_local, H, d] -> [b, P*S_local, H/P, d]: gather the sequence, scatter the heads."""
    return comm.all_to_all_nograd(x_bshd, 2, 1, group, stats, kind)


def heads_to_seq(x_bshd: torch.Tensor, group, stats, kind="all_to_all") -> torch.Tensor:
    """[b, P*S_local, H/P, d] -> [b, S_local, H, d]: the inverse exchange."""
    return comm.all_to_all_nograd(x_bshd, 1, 2, group, stats, kind)


def scatter_heads(q_bshd, k_bshd, v_bshd, group, size, stats):
    """All-to-all q, k, v to head-sharded, full-sequence tensors (k/v replicated if needed)."""
    f = kv_replication(q_bshd.shape[2], k_bshd.shape[2], size)
    if f > 1:
        k_bshd = k_bshd.repeat_interleave(f, dim=2)   # [b, S_local, H_kv*f, d]
        v_bshd = v_bshd.repeat_interleave(f, dim=2)
    return (seq_to_heads(q_bshd, group, stats), seq_to_heads(k_bshd, group, stats),
            seq_to_heads(v_bshd, group, stats))


def _sum_copies(dx_bshd: torch.Tensor, f: int) -> torch.Tensor:
    """repeat_interleave's dual: [b, s, H_kv*f, d] -> [b, s, H_kv, d], each head's f copies summed."""
    if f == 1:
        return dx_bshd
    b, s, h, d = dx_bshd.shape
    return dx_bshd.reshape(b, s, h // f, f, d).sum(3)


def local_heads(per_head: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """The entries of a per-q-head tensor (sinks) for the heads this rank holds after scatter_heads."""
    return per_head.chunk(size)[rank]


def _all_heads(dper_head_local: Optional[torch.Tensor], like: torch.Tensor, size: int, rank: int):
    """local_heads' dual: this rank's heads' gradient in a zero [H] tensor (the others' rows are zero)."""
    if dper_head_local is None:
        return None
    out = torch.zeros_like(like)
    out.chunk(size)[rank].copy_(dper_head_local)
    return out


# Inner = (q_u, k_u, v_u, sinks_h) -> (out_u, lse_u); InnerGrads = (dout_u, q_u, k_u, v_u, out_u, lse_u,
# sinks_h) -> (dq_u, dk_u, dv_u, dsinks_h or None): the attention of the head-sharded, whole-shard tensors
Inner = Callable
InnerGrads = Callable


def head_parallel_forward(ctx, q_bshd, k_bshd, v_bshd, sinks, inner: Inner):
    """(out [b, n, H, d], saved [q_u, k_u, v_u, out_u, lse_u]): all-to-all to head-sharded tensors
    [b, U*n, H/U, d], ``inner`` on them, all-to-all back."""
    q_u, k_u, v_u = scatter_heads(q_bshd, k_bshd, v_bshd, ctx.ulysses_group, ctx.ulysses_size, ctx.stats)
    sinks_h = None if sinks is None else local_heads(sinks, ctx.ulysses_size, ctx.ulysses_rank)
    out_u, lse_u = inner(q_u, k_u, v_u, sinks_h)
    return heads_to_seq(out_u, ctx.ulysses_group, ctx.stats), [q_u, k_u, v_u, out_u, lse_u]


def head_parallel_backward(ctx, dout_bshd, k_bshd, saved: List[torch.Tensor], sinks, inner_grads: InnerGrads):
    """(dq, dk, dv, dsinks or None) of head_parallel_forward: the exchanges in reverse around
    ``inner_grads``, k/v copies summed back."""
    q_u, k_u, v_u, out_u, lse_u = saved
    group, size, stats = ctx.ulysses_group, ctx.ulysses_size, ctx.stats
    dout_u = seq_to_heads(dout_bshd.contiguous(), group, stats)
    sinks_h = None if sinks is None else local_heads(sinks, size, ctx.ulysses_rank)
    dq_u, dk_u, dv_u, dsinks_h = inner_grads(dout_u, q_u, k_u, v_u, out_u, lse_u, sinks_h)
    f = kv_replication(q_u.shape[2] * size, k_bshd.shape[2], size)
    dq = heads_to_seq(dq_u.contiguous(), group, stats)
    dk, dv = (_sum_copies(heads_to_seq(g.contiguous(), group, stats), f) for g in (dk_u, dv_u))
    return dq, dk, dv, _all_heads(dsinks_h, sinks, size, ctx.ulysses_rank)


def fake_head_parallel(ctx, q_bshd, k_bshd, v_bshd):
    """(out, saved) of head_parallel_forward, shapes and dtypes only (the compiler's fake)."""
    b, n, h, d = q_bshd.shape
    u = ctx.ulysses_size
    h_kv = k_bshd.shape[2] * kv_replication(h, k_bshd.shape[2], u)
    dv = v_bshd.shape[-1]
    saved = [q_bshd.new_empty((b, u * n, h // u, d)), k_bshd.new_empty((b, u * n, h_kv // u, d)),
             v_bshd.new_empty((b, u * n, h_kv // u, dv)), q_bshd.new_empty((b, u * n, h // u, dv)),
             q_bshd.new_empty((b, h // u, u * n), dtype=acc_dtype(q_bshd.dtype))]
    return q_bshd.new_empty((b, n, h, dv)), saved


class UlyssesAttention(Strategy):
    name = "ulysses"
    layout_name = "contiguous"

    def __init__(self, ctx):
        super().__init__(ctx)
        whole = make_layout("contiguous", 1)            # after the all-to-all: one position, global order
        self._plans = PlanCache(lambda mask, padded: plan_mask(mask, whole, padded, plain_blocks))

    @staticmethod
    def _kernel_alone(mask: Mask, softcap, sinks) -> bool:
        """A plain mask (end padding at most) and no score modifier: one kernel call on the whole sequence."""
        return mask.docs is None and mask.window is None and mask.blocks is None and softcap is None and sinks is None

    @staticmethod
    def _keys(mask: Mask, padded: int) -> int:
        """Non-causal end padding (padding.py): the real keys are the first ``real`` of the whole sequence."""
        return padded if mask.causal else mask.real(padded)

    def forward(self, q_bshd, k_bshd, v_bshd, mask: Mask, scale, softcap=None, sinks=None):
        ctx = self.ctx

        def inner(q_u, k_u, v_u, sinks_h):
            padded = q_u.shape[1]
            if self._kernel_alone(mask, softcap, sinks):
                keys = self._keys(mask, padded)
                return ctx.kernel.forward(q_u, k_u[:, :keys], v_u[:, :keys], mask.causal, scale)
            # the whole sequence is here, in global order: the plan's bands through the ring loop's
            # single step (one position, nothing travels), which also applies softcap in the kernel and
            # sinks in the final merge
            return ring_forward(q_u, k_u, v_u, scale, ctx, self._plans.get(mask, padded), softcap, sinks_h)
        return head_parallel_forward(ctx, q_bshd, k_bshd, v_bshd, sinks, inner)

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, saved, mask: Mask, scale, softcap=None,
                 sinks=None):
        ctx = self.ctx

        def inner_grads(dout_u, q_u, k_u, v_u, out_u, lse_u, sinks_h):
            padded = q_u.shape[1]
            if self._kernel_alone(mask, softcap, sinks):
                keys = self._keys(mask, padded)
                dq, dk, dv = ctx.kernel.backward(dout_u, q_u, k_u[:, :keys], v_u[:, :keys], out_u, lse_u,
                                                 mask.causal, scale)
                pad = (0, 0, 0, 0, 0, padded - keys)     # the padding keys get no gradient
                return dq, F.pad(dk, pad), F.pad(dv, pad), None
            return ring_grads(dout_u, q_u, k_u, v_u, out_u, lse_u, scale, ctx, self._plans.get(mask, padded),
                              softcap, sinks_h)
        return head_parallel_backward(ctx, dout_bshd, k_bshd, saved, sinks, inner_grads)

    def fake(self, q_bshd, k_bshd, v_bshd, sinks=None):
        return fake_head_parallel(self.ctx, q_bshd, k_bshd, v_bshd)
