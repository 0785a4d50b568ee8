"""Ulysses: all-to-all from sequence-sharded to head-sharded, full-sequence attention, and back.

Notation: P ranks in the Ulysses group, S_local tokens per rank, H q heads, H_kv k/v heads.

    q_bshd [b, S_local, H, d] --all_to_all(heads -> seq)--> [b, P*S_local, H/P, d]
    local kernel over the whole sequence (this rank's H/P heads)
    out    [b, P*S_local, H/P, d] --all_to_all(seq -> heads)--> [b, S_local, H, d]

Backward is the same exchanges in reverse (each all-to-all's backward is its dual).

GQA: K/V travel with their own H_kv heads. When P does not divide H_kv, each k/v head is
repeated the least number of times f = P / gcd(H_kv, P) that makes H_kv*f split over P ranks;
repeat_interleave's backward sums the copies' gradients back. Rank r then holds q heads
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

import torch

from .. import comm
from ..kernels import local_attention
from ..kernels.base import check_head_groups
from ..masks import Mask
from ..sharding.layouts import make_layout
from .base import Strategy
from .mask_plan import PlanCache, plain_blocks, plan_mask
from .ring_loop import ring_attention


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
    return comm.all_to_all(x_bshd, 2, 1, group, stats, kind)


def heads_to_seq(x_bshd: torch.Tensor, group, stats, kind="all_to_all") -> torch.Tensor:
    """[b, P*S_local, H/P, d] -> [b, S_local, H, d]: the inverse exchange."""
    return comm.all_to_all(x_bshd, 1, 2, group, stats, kind)


def scatter_heads(q_bshd, k_bshd, v_bshd, group, size, stats):
    """All-to-all q, k, v to head-sharded, full-sequence tensors (k/v replicated if needed)."""
    f = kv_replication(q_bshd.shape[2], k_bshd.shape[2], size)
    if f > 1:
        k_bshd = k_bshd.repeat_interleave(f, dim=2)   # [b, S_local, H_kv*f, d]
        v_bshd = v_bshd.repeat_interleave(f, dim=2)
    return (seq_to_heads(q_bshd, group, stats), seq_to_heads(k_bshd, group, stats),
            seq_to_heads(v_bshd, group, stats))


def local_heads(per_head: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """The entries of a per-q-head tensor (sinks) for the heads this rank holds after scatter_heads."""
    return per_head.chunk(size)[rank]


class UlyssesAttention(Strategy):
    name = "ulysses"
    layout_name = "contiguous"

    def __init__(self, ctx):
        super().__init__(ctx)
        whole = make_layout("contiguous", 1)            # after the all-to-all: one position, global order
        self._plans = PlanCache(lambda mask, padded: plan_mask(mask, whole, padded, plain_blocks))

    def attention(self, q_bshd, k_bshd, v_bshd, mask: Mask, scale, softcap=None, sinks=None):
        ctx = self.ctx
        q_full, k_full, v_full = scatter_heads(q_bshd, k_bshd, v_bshd, ctx.ulysses_group, ctx.ulysses_size,
                                               ctx.stats)
        padded = q_full.shape[1]
        if mask.docs is not None or mask.window is not None or softcap is not None or sinks is not None:
            # the whole sequence is here, in global order: the plan's bands through the ring loop's
            # single step (one position, nothing travels), which also applies softcap in the kernel and
            # sinks in the final merge
            plan = self._plans.get(mask, padded)
            sinks_h = None if sinks is None else local_heads(sinks, ctx.ulysses_size, ctx.ulysses_rank)
            out_full = ring_attention(q_full, k_full, v_full, scale, ctx, plan, softcap, sinks_h)
            return heads_to_seq(out_full, ctx.ulysses_group, ctx.stats)
        real = mask.real(padded)
        if not mask.causal and real < padded:
            # end padding (padding.py): the real keys are the first ``real`` of the whole sequence
            k_full, v_full = k_full[:, :real], v_full[:, :real]
        out_full = local_attention(q_full, k_full, v_full, ctx.kernel, mask.causal, scale)   # [b, S, H/P, d]
        return heads_to_seq(out_full, ctx.ulysses_group, ctx.stats)
