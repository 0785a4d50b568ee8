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
or, for packed documents, direct sends to the ranks that need a block), ``kernels.merge_`` folds
partial (out, lse) into fp32 accumulators, and a strategy's mask policy
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

Packed documents (cu_seqlens): the policy is varlen.DocumentBlocks, a function of the global
document boundaries; blocks no query of mine shares a document with are skipped, and K/V go only
where they are computed on (transport.DirectKV / DirectGrads): a rank sends its K/V to each rank
that needs them and its dK/dV shares to each rank whose block it needed, instead of P-1 hops of
each (closed_form.ring_masked_bytes; the same bytes when every rank needs every key).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch

from ..kernels import acc_dtype, empty_accumulators, merge_
from ..sharding.padding import valid_prefix
from .bands import SubBlock
from .base import Strategy
from .transport import DirectGrads, DirectKV, RelayGrads, RelayKV


ALL = slice(None)
FULL = [SubBlock(ALL, ALL, False)]          # every (query, key) pair of the block
DIAGONAL = [SubBlock(ALL, ALL, True)]       # the causal square block: query i sees keys j <= i
SKIP: List[SubBlock] = []                   # nothing in this block is visible

BlockPolicy = Callable[[int, int, int, bool, int], Sequence[SubBlock]]


# ---------------------------------------------------------------------------------------------
# forward


def _transports(ctx, blocks):
    """(K/V schedule, dK/dV schedule) classes: direct for masked policies (packed documents, sliding
    windows: the policy says who needs which keys of which block), the relay ring otherwise
    (transport.py)."""
    key_range = getattr(blocks, "key_range", None)
    if key_range is None:
        return RelayKV, RelayGrads, ()
    return DirectKV, DirectGrads, (key_range,)


def _subs(blocks, me, src, p, causal, n, kv) -> Sequence[SubBlock]:
    """The policy's sub-blocks for the block held now, keys shifted into the part that travelled
    (``kv.offset``: a masked schedule sends only the keys a rank can see, transport.py)."""
    if kv.current is None:
        return ()
    subs = blocks(me, src, p, causal, n)
    off = getattr(kv, "offset", 0)
    if not off:
        return subs
    return [s._replace(k=slice(s.k.start - off, s.k.stop - off)) for s in subs]


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


class _FreshRows:
    """Which query rows no sub-block has written yet: a first write is a copy, not a merge."""

    def __init__(self, n: int):
        self._seen = torch.zeros(n, dtype=torch.bool)

    def take(self, rows: slice) -> bool:
        fresh = not bool(self._seen[rows].any())
        self._seen[rows] = True
        return fresh


def ring_forward(q_bshd, k_bshd, v_bshd, causal: bool, scale: float, ctx, blocks: BlockPolicy,
                 softcap: Optional[float] = None, sinks_h: Optional[torch.Tensor] = None):
    """(out_bshd in q's dtype, lse_bhs fp32) of q against the whole ring's K/V; ``softcap`` caps the
    scores in every kernel call, ``sinks_h`` (one logit per q head) join the final merge."""
    p, me, n = ctx.ring_size, ctx.ring_rank, q_bshd.shape[1]
    out_acc_bshd, lse_acc_bhs = empty_accumulators(q_bshd, v_bshd.shape[-1])
    kv_cls, _, extra = _transports(ctx, blocks)
    kv = kv_cls(ctx, +1, (k_bshd, v_bshd), *extra)
    rows = _FreshRows(n)
    for step in range(p):
        src = (me - step) % p                      # forward walk: blocks arrive from me-1
        if ctx.overlap:
            kv.post()                              # next block in flight during this compute
        kv_block = kv.current
        for sub in _subs(blocks, me, src, p, causal, n, kv):
            out_blk, lse_blk = ctx.kernel.forward_block(q_bshd[:, sub.q], kv_block[0][:, sub.k],
                                                        kv_block[1][:, sub.k], sub.causal, sub.anti, scale, softcap)
            if rows.take(sub.q):                   # nothing merged into these rows yet
                out_acc_bshd[:, sub.q].copy_(out_blk)
                lse_acc_bhs[:, :, sub.q].copy_(lse_blk)
            else:
                merge_(out_acc_bshd[:, sub.q], lse_acc_bhs[:, :, sub.q], out_blk, lse_blk)
        if step < p - 1:
            kv.advance()
    if sinks_h is not None:
        apply_sinks_(out_acc_bshd, lse_acc_bhs, sinks_h)
    return out_acc_bshd.to(q_bshd.dtype), lse_acc_bhs


# ---------------------------------------------------------------------------------------------
# backward


def _block_grads(dout_bshd, q_bshd, kv_block, out_bshd, lse_bhs, subs, scale, kernel, softcap):
    """Kernel backward per sub-block, given the final out/lse rows: [(sub, dq, dk, dv)]."""
    return [(sub, *kernel.backward_block(dout_bshd[:, sub.q], q_bshd[:, sub.q], kv_block[0][:, sub.k],
                                         kv_block[1][:, sub.k], out_bshd[:, sub.q], lse_bhs[:, :, sub.q],
                                         sub.causal, sub.anti, scale, softcap))
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
                  ctx, blocks: BlockPolicy, softcap: Optional[float] = None):
    """(dq, dk, dv) of this rank's shards; the ring is walked in reverse (see module doc)."""
    p, me, n = ctx.ring_size, ctx.ring_rank, q_bshd.shape[1]
    dout_bshd = dout_bshd.contiguous()
    kv_cls, grads_cls, extra = _transports(ctx, blocks)
    kv = kv_cls(ctx, -1, (k_bshd, v_bshd), *extra)
    dtype = acc_dtype(q_bshd.dtype)
    dq_acc_bshd = torch.empty(q_bshd.shape, dtype=dtype, device=q_bshd.device)
    dkv_home = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in (k_bshd, v_bshd)]
    dkv_away = grads_cls(ctx, dkv_home, ctx.overlap, *extra)
    for step in range(p):
        src = (me + step) % p                      # reverse walk: blocks arrive from me+1
        if ctx.overlap:
            kv.post()
        kv_block = kv.current
        subs = _subs(blocks, me, src, p, causal, n, kv)
        grads = _block_grads(dout_bshd, q_bshd, kv_block, out_bshd, lse_bhs, subs, scale, ctx.kernel, softcap)
        _sum_into(dq_acc_bshd, [(sub.q, dq) for sub, dq, _, _ in grads], fresh=step == 0)
        if step == 0:
            _sum_kv_into(dkv_home, grads, fresh=True)      # own block: its gradient never leaves
        else:
            dkv_away.add(step, src, lambda acc, fresh, grads=grads: _sum_kv_into(acc, grads, fresh), dkv_home)
        del grads
        if step < p - 1:
            kv.advance()
    dkv_away.land(dkv_home, p)
    return dq_acc_bshd.to(q_bshd.dtype), dkv_home[0].to(k_bshd.dtype), dkv_home[1].to(v_bshd.dtype)


# ---------------------------------------------------------------------------------------------
# autograd and the strategy base


class RingAttentionFunction(torch.autograd.Function):
    """Thin: save what backward needs, call the plain functions."""

    @staticmethod
    def forward(fctx, q_bshd, k_bshd, v_bshd, sinks_h, ctx, blocks, causal, scale, softcap):
        out_bshd, lse_bhs = ring_forward(q_bshd, k_bshd, v_bshd, causal, scale, ctx, blocks, softcap, sinks_h)
        # with sinks, out and lse are the final ones (sinks included): the kernels' backward formulas
        # then give the exact q/k/v gradients (a sink is a key with no value)
        fctx.save_for_backward(q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, sinks_h)
        fctx.ctx, fctx.blocks, fctx.causal, fctx.scale, fctx.softcap = ctx, blocks, causal, scale, softcap
        return out_bshd

    @staticmethod
    def backward(fctx, dout_bshd):
        q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, sinks_h = fctx.saved_tensors
        dq, dk, dv = ring_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, fctx.causal,
                                   fctx.scale, fctx.ctx, fctx.blocks, fctx.softcap)
        dsinks = None if sinks_h is None else sinks_grad(dout_bshd, out_bshd, lse_bhs, sinks_h)
        return dq, dk, dv, dsinks, None, None, None, None, None


def ring_attention(q_bshd, k_bshd, v_bshd, causal: bool, scale: float, ctx, blocks: BlockPolicy,
                   softcap: Optional[float] = None, sinks_h: Optional[torch.Tensor] = None):
    """Differentiable exact attention of this rank's queries against every ring rank's K/V.
    ``sinks_h``: this rank's q heads' sink logits (their gradient is this rank's share)."""
    return RingAttentionFunction.apply(q_bshd, k_bshd, v_bshd, sinks_h, ctx, blocks, causal, scale, softcap)


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

    def attention(self, q_bshd, k_bshd, v_bshd, causal, scale, seq_len=None, docs=None, window=None,
                  softcap=None, sinks=None):
        check_local_length(self.name, self.ctx, q_bshd.shape[1])
        blocks = self.policy(causal, seq_len, q_bshd.shape[1], docs, q_bshd.device, window)
        return ring_attention(q_bshd, k_bshd, v_bshd, causal, scale, self.ctx, blocks, softcap, sinks)

    def policy(self, causal: bool, seq_len, n_ring: int, docs=None, device="cpu", window=None) -> BlockPolicy:
        """The mask policy; with end padding (seq_len < padded length) non-causal blocks keep only
        the real keys, a prefix of each block (padding.py). Causal blocks never see pads. With
        packed documents (``docs``, sharding/documents.py) or a sliding ``window`` the policy
        follows the mask on global positions and leaves the pads out (varlen.py)."""
        padded = n_ring * self.ctx.ring_size
        if docs is not None or window is not None:
            return masked_policy(self.ctx, self.ctx.layout.ring_layout, docs, padded, seq_len, causal, window,
                                 device)
        if causal or seq_len is None or seq_len == padded:
            return self.blocks
        return only_real_keys(self.blocks, valid_prefix(self.ctx.layout.ring_layout, padded, seq_len))


def masked_policy(ctx, layout, docs, padded: int, seq_len, causal: bool, window, device) -> BlockPolicy:
    """varlen.DocumentBlocks over ``layout``'s positions (a single one for Ulysses' whole sequence):
    documents, or the sequence as one document, under the window."""
    from .varlen import document_blocks, one_document
    kernel = ctx.kernel                     # how it wants squares and window bands cut (kernels/base.py)
    docs = docs if docs is not None else one_document(padded, seq_len)
    return document_blocks(docs, layout, causal, lambda size: kernel.causal_tile(size, device), window,
                           lambda width: kernel.band_column(width, device))


def plain_blocks(me: int, src: int, p: int, causal: bool, n: int) -> Sequence[SubBlock]:
    """The policy of one position holding the whole sequence (Ulysses after its all-to-all)."""
    return DIAGONAL if causal else FULL


def only_real_keys(blocks: BlockPolicy, valid: Sequence[int]) -> BlockPolicy:
    """Restrict every (non-causal) sub-block's keys to the first ``valid[src]`` of the block."""
    def policy(me, src, p, causal, n):
        subs = []
        for sub in blocks(me, src, p, causal, n):
            start, stop, _ = sub.k.indices(n)
            stop = min(stop, valid[src])
            if stop > start:
                subs.append(sub._replace(k=slice(start, stop)))
        return subs
    return policy
