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

Packed documents (cu_seqlens): after the all-to-all every rank holds the whole sequence, so local
attention is per document (varlen.py: a causal square per document, or a full one non-causal;
end padding pairs with nothing); the bytes are unchanged.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..kernels import local_attention
from ..kernels.base import check_head_groups
from .base import Strategy
from .ring_loop import ring_attention
from .varlen import whole_sequence_blocks


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


class UlyssesAttention(Strategy):
    name = "ulysses"
    layout_name = "contiguous"

    def attention(self, q_bshd, k_bshd, v_bshd, causal, scale, seq_len=None, docs=None):
        ctx = self.ctx
        q_full, k_full, v_full = scatter_heads(q_bshd, k_bshd, v_bshd, ctx.ulysses_group, ctx.ulysses_size,
                                               ctx.stats)
        if docs is not None:
            # packed documents: the whole sequence is here, in global order; per-document sub-blocks
            # through the ring loop's single step (one position, nothing travels; varlen.py)
            tile = lambda size: ctx.kernel.causal_tile(size, q_full.device)  # noqa: E731
            blocks = whole_sequence_blocks(docs, causal, tile)
            out_full = ring_attention(q_full, k_full, v_full, causal, scale, ctx, blocks)
            return heads_to_seq(out_full, ctx.ulysses_group, ctx.stats)
        if not causal and seq_len is not None and seq_len < k_full.shape[1]:
            # end padding (padding.py): the real keys are the first seq_len of the whole sequence
            k_full, v_full = k_full[:, :seq_len], v_full[:, :seq_len]
        out_full = local_attention(q_full, k_full, v_full, ctx.kernel, causal, scale)   # [b, S, H/P, d]
        return heads_to_seq(out_full, ctx.ulysses_group, ctx.stats)
