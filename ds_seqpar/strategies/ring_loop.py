"""The one ring loop behind ring, zigzag, striped and the 2D hybrid.

Legend (shapes on this rank; "n" is the ring shard this rank holds):

    P            ring size (ctx.ring_size); me = ctx.ring_rank
    src          ring position whose K/V block this rank holds at a given step
    q_bshd       [b, n, H, d]          queries: never move
    kv_block     (k [b, n, H_kv, d], v [b, n, H_kv, dv])   only the kv heads travel (GQA: no repeat)
    out_acc_bshd [b, n, H, dv] fp32    lse_acc_bhs [b, H, n] fp32   (merge accumulators)
    dkv_acc      (dk, dv) fp32, shaped like kv_block: a block's gradient, travelling with it

Three pieces, kept apart, so how K/V travels is separate from what is computed on it: transport.py
moves K/V blocks and their dK/dV between ranks (the relay ring through comm.p2p, double buffered;
or, for masked plans, direct sends to the ranks that need a block), ``kernels.merge_`` folds
partial (out, lse) into fp32 accumulators, and the mask's plan (mask_plan.py: built once per mask,
shared by the layers) says which bands of (my queries) x (src's keys) to compute: a list of
``Band(q, k, lo, hi)`` slices, [] to skip, each one ``kernel.band`` call (a plain plan's bands are
the layout's own full / causal blocks, called as they are).

Forward walks the ring forward: send to me+1, receive from me-1, so step s holds src = me - s.
With ctx.overlap the transfer of the next block is posted before this block's compute.

Backward walks the ring in reverse (the dual of forward's sends): send to me-1, receive from
me+1, so step s holds src = me + s. K/V rotate again (prefetched as in forward). This rank's
share of dK/dV for its own block (step 0) stays home; from step 1 on, a block's fp32 dK/dV
accumulator travels with it: this rank adds its share to the accumulator that arrived from me+1
and sends it on to me-1. At the last step (P-1) this rank holds the block of me-1 and sends its
accumulator to me-1: every accumulator lands at its owner, which adds it to its home share.

Hops per rank: K/V P-1 in forward and P-1 in backward, dK/dV P-1, so the bytes one rank sends
for one forward + backward are exactly

    (P - 1) * (S_k + S_v) * (2*e + e_acc)     = S_kv * (P - 1) * (4*e + 2*e_acc)  when S_k = S_v

with S_k, S_v the elements of the local k, v tensors, e their element size and e_acc = 4 (fp32
accumulators). (Sending the own block's share around as well would cost S_kv*2*e_acc more.)

Packed documents (cu_seqlens) and windows: the plan is a function of the global mask; blocks no
query of mine shares a document with are skipped, and K/V go only where they are computed on
(``plan.direct``: transport.DirectKV / DirectGrads): a rank sends its K/V to each rank that needs
them and its dK/dV shares to each rank whose block it needed, instead of P-1 hops of each
(closed_form.ring_masked_bytes; the same bytes when every rank needs every key).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..kernels import acc_dtype, empty_accumulators
from ..kernels.merge import Merge, Sum
from ..kernels.bands import Band
from ..masks import Mask
from .base import Strategy
from .mask_plan import MaskPlan, plain_blocks, plan_mask  # plain_blocks: bench/window.py imports it here
from .transport import DirectGrads, DirectKV, RelayGrads, RelayKV


# ---------------------------------------------------------------------------------------------
# forward


def _transports(plan: MaskPlan):
    """(K/V schedule, dK/dV schedule) classes and their extra argument: direct for masked plans (the
    plan says who needs which keys of which block), the relay ring otherwise (transport.py)."""
    if plan.direct:
        return DirectKV, DirectGrads, (plan.key_range,)
    return RelayKV, RelayGrads, ()


def _band_forward(kernel, plan: MaskPlan, q_bshd, kv_block, b: Band, scale, softcap, acc: Merge) -> None:
    """One band's (out, lse) folded into the accumulators (merge.py): a plain plan's blocks as the
    kernel's own full / causal blocks, any other band through ``kernel.band``."""
    q, k, v = q_bshd[:, b.q], kv_block[0][:, b.k], kv_block[1][:, b.k]
    if plan.kernel_blocks:
        acc.fold_(b.q, *kernel.forward_block(q, k, v, b.causal, b.anti, scale, softcap))
    else:
        kernel.band(q, k, v, b.lo, b.hi, scale, softcap, into=acc.part(b.q))


def apply_sinks_(out_acc_bshd, lse_acc_bhs, sinks_h) -> None:
    """Sinks (one logit per q head in every row's softmax denominator, no value): the merged
    (out, lse) become out * exp(lse - lse'), lse' = log(exp(lse) + exp(sink)), in place, in the
    accumulators' dtype."""
    lse_new = torch.logaddexp(lse_acc_bhs, sinks_h.to(lse_acc_bhs.dtype).view(1, -1, 1))
    out_acc_bshd.mul_(torch.exp(lse_acc_bhs - lse_new).transpose(1, 2).unsqueeze(-1))
    lse_acc_bhs.copy_(lse_new)


def sinks_grad(dout_bshd, out_bshd, lse_bhs, sinks_h) -> torch.Tensor:
    """d loss / d sink_h = -sum over rows of p_sink * (dout . out), p_sink = exp(sink - lse)."""
    dtype = lse_bhs.dtype
    delta_bhs = (dout_bshd.to(dtype) * out_bshd.to(dtype)).sum(-1).transpose(1, 2)
    p_sink = torch.exp(sinks_h.to(dtype).view(1, -1, 1) - lse_bhs)
    return -(p_sink * delta_bhs).sum((0, 2)).to(sinks_h.dtype)


def ring_forward(q_bshd, k_bshd, v_bshd, scale: float, ctx, plan: MaskPlan,
                 softcap: Optional[float] = None, sinks_h: Optional[torch.Tensor] = None):
    """(out_bshd in q's dtype, lse_bhs fp32) of q against the whole ring's K/V; ``softcap`` caps the
    scores in every kernel call, ``sinks_h`` (one logit per q head) join the final merge."""
    p, me, n = ctx.ring_size, ctx.ring_rank, q_bshd.shape[1]
    out_acc_bshd, lse_acc_bhs = empty_accumulators(q_bshd, v_bshd.shape[-1])
    kv_cls, _, extra = _transports(plan)
    kv = kv_cls(ctx, +1, (k_bshd, v_bshd), *extra)
    acc = Merge(out_acc_bshd, lse_acc_bhs)
    for step in range(p):
        src = (me - step) % p                      # forward walk: blocks arrive from me-1
        if ctx.overlap:
            kv.post()                              # next block in flight during this compute
        kv_block = kv.current
        for b in (plan.received(me, src) if kv_block is not None else ()):
            _band_forward(ctx.kernel, plan, q_bshd, kv_block, b, scale, softcap, acc)
        if step < p - 1:
            kv.advance()
    if sinks_h is not None:
        apply_sinks_(out_acc_bshd, lse_acc_bhs, sinks_h)
    return out_acc_bshd.to(q_bshd.dtype), lse_acc_bhs


# ---------------------------------------------------------------------------------------------
# backward


def _band_grads(dout_bshd, q_bshd, kv_block, out_bshd, lse_bhs, bands, scale, kernel, plan, softcap,
                dq: Sum, dk: Sum, dv: Sum) -> None:
    """Kernel backward per band, given the final out/lse rows, added into the sums (merge.py)."""
    for b in bands:
        args = (dout_bshd[:, b.q], q_bshd[:, b.q], kv_block[0][:, b.k], kv_block[1][:, b.k], out_bshd[:, b.q],
                lse_bhs[:, :, b.q])
        if plan.kernel_blocks:
            for acc, tokens, g in zip((dq, dk, dv), (b.q, b.k, b.k),
                                      kernel.backward_block(*args, b.causal, b.anti, scale, softcap)):
                acc.add_(tokens, g)
        else:
            kernel.band_backward(*args, b.lo, b.hi, scale, softcap, into=(dq.part(b.q), dk.part(b.k), dv.part(b.k)))


def _fold_into(dkv_acc, step_sums, fresh: bool) -> None:
    """A block's dK/dV shares of this step into its (travelling or sent) accumulator; ``fresh``: the
    accumulator is uninitialised and becomes exactly the shares."""
    for acc, share in zip(dkv_acc, step_sums or (None, None)):
        if share is None:
            if fresh:
                acc.zero_()
        elif fresh:
            acc.copy_(share.total())
        else:
            acc += share.total()


def ring_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, scale: float, ctx, plan: MaskPlan,
                  softcap: Optional[float] = None):
    """(dq, dk, dv) of this rank's shards; the ring is walked in reverse (see module doc)."""
    p, me = ctx.ring_size, ctx.ring_rank
    dout_bshd = dout_bshd.contiguous()
    kv_cls, grads_cls, extra = _transports(plan)
    kv = kv_cls(ctx, -1, (k_bshd, v_bshd), *extra)
    dq = Sum.empty(q_bshd)
    home = [Sum.empty(t) for t in (k_bshd, v_bshd)]
    dkv_home = [s.acc for s in home]
    dkv_away = grads_cls(ctx, dkv_home, ctx.overlap, *extra)
    for step in range(p):
        src = (me + step) % p                      # reverse walk: blocks arrive from me+1
        if ctx.overlap:
            kv.post()
        kv_block = kv.current
        bands = plan.received(me, src) if kv_block is not None else ()
        if step == 0:                              # own block: its gradient never leaves
            _band_grads(dout_bshd, q_bshd, kv_block, out_bshd, lse_bhs, bands, scale, ctx.kernel, plan, softcap,
                        dq, *home)
            for s in home:
                s.total()
        else:                                      # shares summed now, folded where the transport says
            shares = [Sum.empty(t) for t in kv_block] if bands else None
            if bands:
                _band_grads(dout_bshd, q_bshd, kv_block, out_bshd, lse_bhs, bands, scale, ctx.kernel, plan, softcap,
                            dq, *shares)
            dkv_away.add(step, src, lambda acc, fresh, shares=shares: _fold_into(acc, shares, fresh), dkv_home)
            del shares
        if step < p - 1:
            kv.advance()
    dkv_away.land(dkv_home, p)
    return dq.total().to(q_bshd.dtype), dkv_home[0].to(k_bshd.dtype), dkv_home[1].to(v_bshd.dtype)


# ---------------------------------------------------------------------------------------------
# gradients and the strategy base


def ring_grads(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, scale: float, ctx, plan: MaskPlan,
               softcap: Optional[float] = None, sinks_h: Optional[torch.Tensor] = None):
    """(dq, dk, dv, dsinks or None) of ring_forward. With sinks, out and lse are the final ones (sinks
    included): the kernels' backward formulas then give the exact q/k/v gradients (a sink is a key
    with no value)."""
    dq, dk, dv = ring_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, scale, ctx, plan, softcap)
    dsinks = None if sinks_h is None else sinks_grad(dout_bshd, out_bshd, lse_bhs, sinks_h)
    return dq, dk, dv, dsinks


def check_local_length(strategy_name: str, ctx, n_local: int) -> None:
    """ValueError before any communication (same on every rank) when the layout cannot hold
    ``n_local`` tokens per rank; says which local and global lengths would work."""
    layout = ctx.layout
    multiple = layout.required_multiple                 # of the global length
    n_global = n_local * ctx.sp_size
    if n_local >= 1 and n_global % multiple == 0:
        return
    local_multiple = multiple // math.gcd(multiple, ctx.sp_size)
    below, above = n_global // multiple * multiple, (n_global // multiple + 1) * multiple
    fix = f"pad the sequence to {above}" + (f" or truncate it to {below}" if below else "")
    raise ValueError(
        f"sequence_parallel.strategy={strategy_name!r} (ring_size={ctx.ring_size}, "
        f"ulysses_size={ctx.ulysses_size}) needs a local sequence length that is a multiple of "
        f"{local_multiple} (global: a multiple of {multiple}, as the {layout.name} layout needs); got "
        f"{n_local} tokens per rank, a global length of {n_global}: {fix}")


class RingFamily(Strategy):
    """Base of ring, zigzag and striped: attention is the ring loop over the mask's plan."""

    name = "ring_family"

    def __init__(self, ctx):
        super().__init__(ctx)
        self._build = lambda mask, padded: plan_mask(mask, self.ctx.layout.ring_layout, padded, self.blocks)

    @staticmethod
    def blocks(me: int, src: int, p: int, causal: bool, n: int):
        """The layout's hand-derived bands of a plain mask (mask_plan.py)."""
        raise NotImplementedError

    def plan(self, mask: Mask, n_ring: int) -> MaskPlan:
        """The plan of ``mask`` over the ring positions, each holding ``n_ring`` tokens (built once per
        mask: the plans the context keeps, sharding/batch_masks.py)."""
        return self.ctx.plans.get(mask, n_ring * self.ctx.ring_size, self._build)

    def forward(self, q_bshd, k_bshd, v_bshd, mask: Mask, scale, softcap=None, sinks=None):
        check_local_length(self.name, self.ctx, q_bshd.shape[1])
        plan = self.plan(mask, q_bshd.shape[1])
        out_bshd, lse_bhs = ring_forward(q_bshd, k_bshd, v_bshd, scale, self.ctx, plan, softcap, sinks)
        return out_bshd, [lse_bhs]

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, saved, mask: Mask, scale, softcap=None,
                 sinks=None):
        plan = self.plan(mask, q_bshd.shape[1])
        return ring_grads(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, saved[0], scale, self.ctx, plan, softcap,
                          sinks)

    def fake(self, q_bshd, k_bshd, v_bshd, sinks=None):
        check_local_length(self.name, self.ctx, q_bshd.shape[1])
        return fake_ring(q_bshd, v_bshd)


def fake_ring(q_bshd, v_bshd):
    """(out, [lse]) as ring_forward returns them, shapes and dtypes only (the compiler's fake)."""
    b, n, h, _ = q_bshd.shape
    out = q_bshd.new_empty((b, n, h, v_bshd.shape[-1]))
    return out, [q_bshd.new_empty((b, h, n), dtype=acc_dtype(q_bshd.dtype))]
