"""2D hybrid (USP): Ulysses all-to-all inside groups of U neighbouring ranks, a ring strategy
(ring, zigzag or striped) across the R = size / U groups.

Notation: U = ctx.ulysses_size, R = ctx.ring_size, n = local tokens per rank, H / H_kv = q / kv
heads. The layout (layouts.HybridLayout) is the ring strategy's layout over R positions with each
ring shard cut contiguously into U pieces, so one Ulysses group together holds one ring shard.

Math -> code:

    q_bshd [b, n, H, d] --all_to_all in ulysses_group (ulysses.head_parallel_forward)--> [b, U*n, H/U, d]
        (k, v likewise with H_kv heads, repeated f = U / gcd(H_kv, U) times only if U does not
        divide H_kv); the U*n tokens are this ring position's shard, in its local order
    ring loop over ring_group on those tensors, with the mask's plan over the ring strategy's layout
    out [b, U*n, H/U, d] --all_to_all back --> [b, n, H, d]

Attention is independent per head, so splitting heads inside the group and running the ring
across groups is exact. Head chunks (ulysses_chunks): the sandwich runs per chunk of whole K/V
groups (ulysses.head_parallel_forward), each chunk's ring loop computing while the next chunk's
all-to-all travels; the ring then sends each block once per chunk, a chunk's share of its bytes.
Backward: the ring loop's backward between the two all-to-alls' duals.
U == size (R == 1) is Ulysses with the ring's single diagonal step; U == 1 is never routed here
(strategies.build then returns the ring strategy itself).

Constraints: U divides H (key "sequence_parallel.ulysses_size"), checked before communication;
the ring layout's length rule applies to the ring shard U*n (zigzag: U*n even).

Bytes sent per rank, one forward + backward, element size e, e_acc = 4, S = elements of one local
full-head tensor [b, n, H, d], S_kv = elements of the local k:

    Ulysses: (U-1)/U * e * (4*S + 4*f*S_kv)           q, out, dout, dq and k, v, dk, dv
    ring:    f*S_kv * (R - 1) * (4*e + 2*e_acc)       the ring form on the head-sharded,
                                                     U-times-longer k: U*n * f*H_kv/U * d = f*S_kv
"""
from __future__ import annotations

from .ring_loop import RingFamily, check_local_length, ring_forward, ring_grads
from .ulysses import fake_head_parallel, head_parallel_backward, head_parallel_forward


class HybridAttention(RingFamily):
    """Composition: Ulysses all-to-alls around ``ring``'s loop. ``ring`` is the ring, zigzag or
    striped strategy built over the same context; its blocks (a plain mask's plan) and layout are used as they are."""

    name = "hybrid"

    def __init__(self, ctx, ring: RingFamily):
        super().__init__(ctx)
        self.ring = ring
        self.layout_name = ring.layout_name

    def blocks(self, me, src, p, causal, n):
        return self.ring.blocks(me, src, p, causal, n)

    def forward(self, q_bshd, k_bshd, v_bshd, mask, scale, softcap=None, sinks=None):
        ctx = self.ctx
        check_local_length(self.ring.name, ctx, q_bshd.shape[1])
        # [b, n, H, d] -> [b, U*n, H/U, d]: this ring position's whole shard, a slice of the heads; the
        # ring strategy's blocks over U*n-token shards
        return head_parallel_forward(ctx, q_bshd, k_bshd, v_bshd, sinks, lambda q_u, k_u, v_u, sinks_h: ring_forward(
            q_u, k_u, v_u, scale, ctx, self.plan(mask, q_u.shape[1]), softcap, sinks_h))

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, saved, mask, scale, softcap=None, sinks=None):
        ctx = self.ctx

        def inner_grads(dout_u, q_u, k_u, v_u, out_u, lse_u, sinks_h):
            return ring_grads(dout_u, q_u, k_u, v_u, out_u, lse_u, scale, ctx, self.plan(mask, q_u.shape[1]),
                              softcap, sinks_h)
        return head_parallel_backward(ctx, dout_bshd, k_bshd, saved, sinks, inner_grads)

    def fake(self, q_bshd, k_bshd, v_bshd, sinks=None):
        check_local_length(self.ring.name, self.ctx, q_bshd.shape[1])
        return fake_head_parallel(self.ctx, q_bshd, k_bshd, v_bshd)
