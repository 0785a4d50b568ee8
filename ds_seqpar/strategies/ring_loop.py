"""The one ring loop behind ring, zigzag, striped and the 2D hybrid.

Legend (shapes on this rank; "n" is the ring shard this rank holds):

    P            ring size (ctx.ring_size); me = ctx.ring_rank
    src          ring position whose K/V block this rank holds at a given step
    q_bshd       [b, n, H, d]          queries: never move
    kv_block     (k [b, n, H_kv, d], v [b, n, H_kv, dv])   only the kv heads travel (GQA: no repeat)
    out_acc_bshd [b, n, H, dv] fp32    lse_acc_bhs [b, H, n] fp32   (merge accumulators)
    dkv_acc      (dk, dv) fp32, shaped like kv_block: a block's gradient, travelling with it

Three pieces, kept apart, so how K/V travels is separate from what is computed on it: ``_Ring``
rotates same-shaped tensors around the ring through comm.p2p (double buffered), ``kernels.merge_``
folds partial (out, lse) into fp32 accumulators, and a strategy's mask policy
``blocks(me, src, P, causal, n)`` says which sub-blocks of (my queries) x (src's keys) to compute:
a list of ``SubBlock(q, k, causal)`` slices, [] to skip.
``causal`` on a sub-block means top-left on a square block, the only kind the kernels accept.

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
"""
from __future__ import annotations

import math
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

from .. import comm
from ..kernels import empty_accumulators, merge_
from ..sharding.padding import valid_prefix
from .base import Strategy


class SubBlock(NamedTuple):
    """One kernel call: queries q_bshd[:, q] against keys kv[:, k], causal (square) or full."""

    q: slice
    k: slice
    causal: bool


ALL = slice(None)
FULL = [SubBlock(ALL, ALL, False)]          # every (query, key) pair of the block
DIAGONAL = [SubBlock(ALL, ALL, True)]       # the causal square block: query i sees keys j <= i
SKIP: List[SubBlock] = []                   # nothing in this block is visible

BlockPolicy = Callable[[int, int, int, bool, int], Sequence[SubBlock]]


class _Ring:
    """Rotates a tuple of same-shaped tensors one hop per call, ``shift`` ranks along the ring.

    Double buffer: receives land in buffers this object owns; a buffer that was sent on becomes
    free again once its transfer is waited for, so P steps use at most two buffer sets.
    """

    def __init__(self, ctx, shift: int, kind: str):
        p, r = ctx.ring_size, ctx.ring_rank
        self.dst, self.src = (r + shift) % p, (r - shift) % p
        self.group, self.stats, self.kind = ctx.ring_group, ctx.stats, kind
        self._free: List[List[torch.Tensor]] = []
        self._pending: Optional[comm.PendingP2P] = None
        self._sent_owned: Optional[List[torch.Tensor]] = None
        self._received: Optional[List[torch.Tensor]] = None

    def buffers(self, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """A free buffer set shaped like ``like`` (contiguous), reused when one is available."""
        if self._free:
            return self._free.pop()
        return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]

    def start(self, tensors: Sequence[torch.Tensor], owned: bool) -> None:
        """Post: send ``tensors`` to dst, receive the next ones from src. ``owned``: the tensors
        are buffers of this ring (reusable once sent), not the caller's inputs."""
        recv = self.buffers(tensors)
        self._pending = comm.p2p([(t, self.dst) for t in tensors], [(b, self.src) for b in recv],
                                 self.group, self.stats, self.kind)
        self._sent_owned = list(tensors) if owned else None
        self._received = None

    def finish(self) -> List[torch.Tensor]:
        """Wait for the posted hop (idempotent); return the received tensors."""
        if self._received is None:
            self._received = self._pending.wait()
            if self._sent_owned is not None:
                self._free.append(self._sent_owned)
            self._pending = self._sent_owned = None
        return self._received


# ---------------------------------------------------------------------------------------------
# forward


def ring_forward(q_bshd, k_bshd, v_bshd, causal: bool, scale: float, ctx, blocks: BlockPolicy):
    """(out_bshd in q's dtype, lse_bhs fp32) of q against the whole ring's K/V."""
    p, me, n = ctx.ring_size, ctx.ring_rank, q_bshd.shape[1]
    out_acc_bshd, lse_acc_bhs = empty_accumulators(q_bshd, v_bshd.shape[-1])
    ring = _Ring(ctx, shift=+1, kind="ring")
    kv_block, fresh = (k_bshd, v_bshd), True
    for step in range(p):
        src = (me - step) % p                      # forward walk: blocks arrive from me-1
        more = step < p - 1
        if more and ctx.overlap:
            ring.start(kv_block, owned=step > 0)   # next block in flight during this compute
        for sub in blocks(me, src, p, causal, n):
            out_blk, lse_blk = ctx.kernel.forward(q_bshd[:, sub.q], kv_block[0][:, sub.k],
                                                  kv_block[1][:, sub.k], sub.causal, scale)
            if fresh and sub.q == ALL:             # nothing merged yet: the block is the result
                out_acc_bshd.copy_(out_blk)
                lse_acc_bhs.copy_(lse_blk)
            else:
                merge_(out_acc_bshd[:, sub.q], lse_acc_bhs[:, :, sub.q], out_blk, lse_blk)
            fresh = False
        if more:
            if not ctx.overlap:
                ring.start(kv_block, owned=step > 0)
            kv_block = tuple(ring.finish())
    return out_acc_bshd.to(q_bshd.dtype), lse_acc_bhs


# ---------------------------------------------------------------------------------------------
# backward


def _block_grads(dout_bshd, q_bshd, kv_block, out_bshd, lse_bhs, subs, scale, kernel):
    """Kernel backward per sub-block, given the final out/lse rows: [(sub, dq, dk, dv)]."""
    return [(sub, *kernel.backward(dout_bshd[:, sub.q], q_bshd[:, sub.q], kv_block[0][:, sub.k],
                                   kv_block[1][:, sub.k], out_bshd[:, sub.q], lse_bhs[:, :, sub.q],
                                   sub.causal, scale))
            for sub in subs]


def _sum_into(acc, pieces, fresh: bool) -> None:
    """acc[:, s] += x for each (s, x). ``fresh``: acc is uninitialised and becomes exactly the sum
    (a whole-width first piece is copied in, saving a zero-fill and an add pass)."""
    if fresh:
        if pieces and pieces[0][0] == ALL:
            acc.copy_(pieces[0][1])
            pieces = pieces[1:]
        else:
            acc.zero_()
    for sl, x in pieces:
        acc[:, sl] += x


def _sum_kv_into(dkv_acc, grads, fresh: bool) -> None:
    _sum_into(dkv_acc[0], [(sub.k, dk) for sub, _, dk, _ in grads], fresh)
    _sum_into(dkv_acc[1], [(sub.k, dv) for sub, _, _, dv in grads], fresh)


def ring_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal: bool, scale: float,
                  ctx, blocks: BlockPolicy):
    """(dq, dk, dv) of this rank's shards; the ring is walked in reverse (see module doc)."""
    p, me, n = ctx.ring_size, ctx.ring_rank, q_bshd.shape[1]
    dout_bshd = dout_bshd.contiguous()
    kv_ring = _Ring(ctx, shift=-1, kind="ring")
    dkv_ring = _Ring(ctx, shift=-1, kind="ring_grad")
    kv_block = (k_bshd, v_bshd)
    dq_acc_bshd = torch.empty(q_bshd.shape, dtype=torch.float32, device=q_bshd.device)
    dkv_home = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in kv_block]
    for step in range(p):
        src = (me + step) % p                      # reverse walk: blocks arrive from me+1
        more = step < p - 1
        if more and ctx.overlap:
            kv_ring.start(kv_block, owned=step > 0)
        grads = _block_grads(dout_bshd, q_bshd, kv_block, out_bshd, lse_bhs, blocks(me, src, p, causal, n),
                             scale, ctx.kernel)
        _sum_into(dq_acc_bshd, [(sub.q, dq) for sub, dq, _, _ in grads], fresh=step == 0)
        if step == 0:
            _sum_kv_into(dkv_home, grads, fresh=True)      # own block: its gradient never leaves
        else:
            # step 1 starts src's travelling accumulator; later steps add to the one that arrived
            dkv_acc = dkv_ring.buffers(dkv_home) if step == 1 else dkv_ring.finish()
            _sum_kv_into(dkv_acc, grads, fresh=step == 1)
            dkv_ring.start(dkv_acc, owned=True)
            if not ctx.overlap:
                dkv_ring.finish()
        del grads
        if more:
            if not ctx.overlap:
                kv_ring.start(kv_block, owned=step > 0)
            kv_block = tuple(kv_ring.finish())
    if p > 1:
        for home, arrived in zip(dkv_home, dkv_ring.finish()):   # own accumulator, back from me+1
            home += arrived
    return dq_acc_bshd.to(q_bshd.dtype), dkv_home[0].to(k_bshd.dtype), dkv_home[1].to(v_bshd.dtype)


# ---------------------------------------------------------------------------------------------
# autograd and the strategy base


class RingAttentionFunction(torch.autograd.Function):
    """Thin: save what backward needs, call the plain functions."""

    @staticmethod
    def forward(fctx, q_bshd, k_bshd, v_bshd, ctx, blocks, causal, scale):
        out_bshd, lse_bhs = ring_forward(q_bshd, k_bshd, v_bshd, causal, scale, ctx, blocks)
        fctx.save_for_backward(q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs)
        fctx.ctx, fctx.blocks, fctx.causal, fctx.scale = ctx, blocks, causal, scale
        return out_bshd

    @staticmethod
    def backward(fctx, dout_bshd):
        q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs = fctx.saved_tensors
        dq, dk, dv = ring_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, fctx.causal,
                                   fctx.scale, fctx.ctx, fctx.blocks)
        return dq, dk, dv, None, None, None, None


def ring_attention(q_bshd, k_bshd, v_bshd, causal: bool, scale: float, ctx, blocks: BlockPolicy):
    """Differentiable exact attention of this rank's queries against every ring rank's K/V."""
    return RingAttentionFunction.apply(q_bshd, k_bshd, v_bshd, ctx, blocks, causal, scale)


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
    """Base of ring, zigzag and striped: attention is the ring loop driven by ``blocks``."""

    name = "ring_family"

    @staticmethod
    def blocks(me: int, src: int, p: int, causal: bool, n: int) -> Sequence[SubBlock]:
        raise NotImplementedError

    def attention(self, q_bshd, k_bshd, v_bshd, causal, scale, seq_len=None):
        check_local_length(self.name, self.ctx, q_bshd.shape[1])
        blocks = self.policy(causal, seq_len, q_bshd.shape[1])
        return ring_attention(q_bshd, k_bshd, v_bshd, causal, scale, self.ctx, blocks)

    def policy(self, causal: bool, seq_len, n_ring: int) -> BlockPolicy:
        """The mask policy; with end padding (seq_len < padded length) non-causal blocks keep only
        the real keys, a prefix of each block (padding.py). Causal blocks never see pads."""
        padded = n_ring * self.ctx.ring_size
        if causal or seq_len is None or seq_len == padded:
            return self.blocks
        return only_real_keys(self.blocks, valid_prefix(self.ctx.layout.ring_layout, padded, seq_len))


def only_real_keys(blocks: BlockPolicy, valid: Sequence[int]) -> BlockPolicy:
    """Restrict every (non-causal) sub-block's keys to the first ``valid[src]`` of the block."""
    def policy(me, src, p, causal, n):
        subs = []
        for sub in blocks(me, src, p, causal, n):
            start, stop, _ = sub.k.indices(n)
            stop = min(stop, valid[src])
            if stop > start:
                subs.append(SubBlock(sub.q, slice(start, stop), sub.causal))
        return subs
    return policy
