"""LASP: causal linear attention over a sequence split contiguously: rank r holds tokens [r*L, (r+1)*L).

Notation: P ranks in the sequence group, r = this rank, L local tokens (the same on every rank),
B batch, H q heads (Hkv k/v heads, GQA), Dk, Dv head dims, lambda_h the fixed per-head decay (1
without). States are [B, H, Dk, Dv] in fp32 (fp64 for fp64 inputs), one per q head.

    o_t        = q_t . sum_{s<=t} lambda^(t-s) k_s^T v_s             over the WHOLE sequence
    S_r        = sum_{s in rank r} lambda^(L-1-s) k_s^T v_s             this rank's state_local
    state_in_r = sum_{r'<r} lambda^(L (r-1-r')) S_r'                    (0 on rank 0)
               = lambda^L state_in_{r-1} + S_{r-1}                      the ring recurrence

Math -> code (kernel phases in kernels/linear/forward.py and backward.py; they know nothing of
ranks). Inside a block the kernel needs every chunk's own k^T v and their prefix scan anyway; S_r is
the scan's end, and a state_in starts the scan, so its share of o rides on the q . (chunk state)
product the kernel has for every chunk. Backward mirrors it: G_r is the reverse scan of the per-chunk q^T do products at
the block start, and dS_r starts the reverse scan, so dk, dv through the chunk states take it along.

    S_r        = forward_states(fwd)                      after forward_begin's chunk products
    o_r        = forward_finish(fwd)  after forward_states(fwd, state_in_r) folded state_in_r in
    G_r        = backward_begin(..., state_in_r).dstate_in   (q and do only; through o only)
    dS_r       = sum_{r'>r} lambda^(L (r'-1-r)) G_r'                    (0 on the last rank)
    dq, dk, dv = backward_finish(bwd, dS_r)              after backward_local(bwd)

How states travel is kept apart from what is computed on them: each rank's block is a fragment
whose transition is the fixed lambda^L, and the states go through the exchange the hybrids' linear
layers use (lasp_comm/: one file per lasp_comm value, picked by name):

- "ring" (LASP-1). Forward: rank r receives state_in from r-1 and forwards
  lambda^L state_in + S_r to r+1: P-1 sequential hops. Backward walks the ring in reverse:
  dstate flows from r+1 to r; rank r receives D_{r+1} (= dS_r, the gradient of the state it sent)
  and forwards D_r = G_r + lambda^L D_{r+1} to r-1.
- "allscan" (All-Scan). The ring's order, but every rank has S_r before state_in comes and the
  state travels in K blocks along Dv (lasp_comm/allscan.py, scan_blocks): rank r forwards block k of
  lambda^L state_in + S_r as soon as block k of state_in came, so a hop waits for one block, not
  for the rank's scan. Backward the same in reverse with D_r = G_r + lambda^L D_{r+1} per block.
- "allgather" (LASP-2). Forward: all-gather every S_r', then a local decay-weighted
  prefix sum. Backward is the dual collective: rank r puts lambda^(L (r-1-r')) G_r in slot r' < r
  of a [P, 1, B, H, Dk, Dv] buffer and a reduce-scatter hands each rank the sum for its own S.

Overlap (ctx.overlap): the bulk of the local work never waits for a state, and nothing is computed
twice. Forward: forward_begin (chunk products), then S_r (their scan) is posted where it must leave
before the local work (rank 0 on the ring, ranks < P-1 for the all-gather); ranks > 0 run the
intra-chunk part (forward_diagonal) while states travel, then wait and fold state_in into the scan
(one pass over the chunk states if S_r was scanned already, else the scan itself) and finish with
q . (chunk states). Middle ring ranks forward the state after their block (lambda^L state_in + S_r,
the end of that scan) as soon as state_in arrived. Backward: ranks > 0 compute G_r first (one
q^T do product per chunk, which the local work reuses, and a reverse scan), post it, run
backward_local (the bulk), then wait for dS_r, which joins the reverse walk over the chunks. Without
overlap every transfer is waited for as soon as it is posted; the kernel calls are the same, so both
give bit-identical results. Values nobody reads are not computed: the last rank's S (the all-gather
still carries it: zeros), rank 0's G.

Bytes sent per rank, one forward + backward; state_bytes = B*H*Dk*Dv*4 (8 for fp64 inputs):

    ring:       state_bytes * ([r < P-1] + [r > 0])      one state forward, one dstate backward
    allscan:    state_bytes * ([r < P-1] + [r > 0])      the ring's, in K messages per hop
    allgather:  state_bytes * 2 * (P-1)                  all-gather (P-1); reduce-scatter (P-1)/P of P
None of it depends on L: LASP's communication does not grow with the sequence.

Packed documents (cu_seqlens): the state restarts at every document start. lasp_chain.py says which
states cross which rank boundaries: a rank's block is cut at the document starts inside it into
segments; the first continues state_in (unless a document starts at the block start), the last one's
local state goes out, the ones between are documents of their own (plain intra-block kernel, no
state). LASP-1 sends a state (and its gradient back) only across boundaries a document crosses;
LASP-2 sums over the ranks whose states reach this one (chain(r)) and, when no document crosses any
boundary, exchanges nothing. Without documents the plan is the one above, call for call.

Constraints: every rank holds L tokens (contiguous layout); GQA native (states are per q head, so
H states travel even when kv heads share one without decay); decay None or a fixed [H] tensor in
(0, 1] (checked before any communication).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..kernels.linear import (backward_begin, backward_finish, backward_local, check_inputs, forward_begin,
                                forward_diagonal, forward_finish, forward_states, intra_backward, intra_forward,
                                state_dtype)
from .base import Strategy
from .lasp_chain import LaspChain
from .lasp_comm import exchange_for
from .lasp_comm.common import FixedDecay

CHUNK_SIZE = 64          # the kernel's chunk, as single-process linear_attention uses


def _exchange(ctx, q_bshd, v_bshd, decay_h, chain: LaspChain):
    """This rank's side of the state exchange; its states [B, H, Dk, Dv], the transition lambda^L."""
    b, _, heads, dk = q_bshd.shape
    dtype = state_dtype(q_bshd.dtype)
    like = torch.empty((b, heads, dk, v_bshd.shape[-1]), dtype=dtype, device=q_bshd.device)   # a template only
    return exchange_for(ctx.lasp_comm)(chain, ctx.sp_rank, ctx.sp_group, ctx.stats, like, FixedDecay(decay_h, dtype),
                                    ctx.overlap)


# ---------------------------------------------------------------------------------------------
# forward and backward


def _cut(seg: Tuple[int, int], *xs: Tensor):
    return tuple(x[:, seg[0]:seg[1]] for x in xs)


def _joined(parts, single: bool):
    return parts[0] if single else torch.cat(parts, dim=1)


def lasp_forward(q_bshd, k_bshd, v_bshd, decay_h, ctx, chain: LaspChain,
                 chunk_size=CHUNK_SIZE) -> Tuple[Tensor, Optional[Tensor]]:
    """(o_bshd, state_in_bhkv or None where no state comes in) of this rank's block of the whole
    sequence. The block is one segment without documents; with them, the first segment continues
    state_in, the last one's S goes out, and the ones between are documents of their own."""
    check_inputs(q_bshd, k_bshd, v_bshd, decay_h)      # the same error on every rank, before any transfer
    states = _exchange(ctx, q_bshd, v_bshd, decay_h, chain)
    segs = chain.segments[ctx.sp_rank]
    single = len(segs) == 1
    fwd = forward_begin(*_cut(segs[0], q_bshd, k_bshd, v_bshd), decay_h, chunk_size)   # each chunk's k^T v
    fwd_last = fwd if single else forward_begin(*_cut(segs[-1], q_bshd, k_bshd, v_bshd), decay_h, chunk_size)
    last = len(segs) - 1
    states.post({last: forward_states(fwd_last)} if states.needs_local_state(last) else {})   # S_r: their scan
    outs = [None] * len(segs)
    for i, seg in enumerate(segs[1:-1], start=1):      # documents inside the block: no state in or out
        outs[i] = intra_forward(*_cut(seg, q_bshd, k_bshd, v_bshd), decay_h, chunk_size)[0]
    if not single:
        outs[-1] = forward_finish(fwd_last)
    state_in = None
    if states.fed(0):
        forward_diagonal(fwd)                           # the intra-chunk work, while states travel
        state_in = states.state_in(0)
        states.pass_on(0, forward_states(fwd, state_in))   # state_in joins the chunk-state scan
    outs[0] = forward_finish(fwd)                       # q . (chunk states), state_in's share included
    states.finish()
    return _joined(outs, single), state_in


def lasp_backward(do_bshd, q_bshd, k_bshd, v_bshd, state_in, decay_h, ctx, chain: LaspChain,
                  chunk_size=CHUNK_SIZE):
    """(dq, dk, dv) of lasp_forward; dstates flow towards earlier ranks (see the module doc)."""
    segs = chain.segments[ctx.sp_rank]
    single = len(segs) == 1
    do_bshd = do_bshd.contiguous()
    bwd = backward_begin(*_cut(segs[0], do_bshd, q_bshd, k_bshd, v_bshd), decay_h, chunk_size, state_in)
    states = _exchange(ctx, q_bshd, v_bshd, decay_h, chain)
    states.post_dstate({0: bwd.dstate_in} if states.fed(0) else {})   # G_r: from q and do alone
    backward_local(bwd)                                 # the bulk, while dstates travel
    if single:
        grads = [backward_finish(bwd, states.dstate_out(0))]   # dS_r joins the reverse walk
    else:
        grads = [backward_finish(bwd)]
        grads += [intra_backward(*_cut(seg, do_bshd, q_bshd, k_bshd, v_bshd), decay_h, chunk_size)
                  for seg in segs[1:-1]]
        bwd_last = backward_begin(*_cut(segs[-1], do_bshd, q_bshd, k_bshd, v_bshd), decay_h, chunk_size)
        backward_local(bwd_last)
        grads.append(backward_finish(bwd_last, states.dstate_out(len(segs) - 1)))
    states.finish()
    return tuple(_joined([g[i] for g in grads], single) for i in range(3))


class LaspAttention(Strategy):
    """sp.linear_attention via LASP (its forward / backward / fake, which ds_seqpar/ops registers as one
    opaque node); sp.attention raises (Strategy base) and names the fix."""

    name = "lasp"
    layout_name = "contiguous"
    CHAINS = 8               # plans kept: the plain one per local length, and the latest batches' documents

    def __init__(self, ctx):
        super().__init__(ctx)
        exchange_for(ctx.lasp_comm)         # an unknown lasp_comm is refused here, before any transfer
        self._chains = OrderedDict()

    def chain(self, n: int, docs=None) -> LaspChain:
        """The plan of a local length ``n`` (and packed documents), built once and shared by the layers."""
        key = (n, None if docs is None else tuple(docs.bounds))
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = LaspChain(self.ctx.sp_size, n, docs)
            if len(self._chains) > self.CHAINS:
                self._chains.popitem(last=False)
        return chain

    def linear_forward(self, q_bshd, k_bshd, v_bshd, decay: Optional[Tensor], docs=None):
        """(o, [state_in]): state_in zeros where no state comes in (its backward knows from the plan)."""
        o_bshd, state_in = lasp_forward(q_bshd, k_bshd, v_bshd, decay, self.ctx, self.chain(q_bshd.shape[1], docs))
        return o_bshd, [state_in if state_in is not None else self._state_like(q_bshd, v_bshd).zero_()]

    def linear_backward(self, do_bshd, q_bshd, k_bshd, v_bshd, saved, decay: Optional[Tensor], docs=None):
        chain = self.chain(q_bshd.shape[1], docs)
        state_in = saved[0] if chain.takes_in[self.ctx.sp_rank] else None
        return lasp_backward(do_bshd, q_bshd, k_bshd, v_bshd, state_in, decay, self.ctx, chain)

    def linear_fake(self, q_bshd, k_bshd, v_bshd):
        b, n, h, _ = q_bshd.shape
        return q_bshd.new_empty((b, n, h, v_bshd.shape[-1])), [self._state_like(q_bshd, v_bshd)]

    @staticmethod
    def _state_like(q_bshd, v_bshd) -> Tensor:
        b, _, h, dk = q_bshd.shape
        return q_bshd.new_empty((b, h, dk, v_bshd.shape[-1]), dtype=state_dtype(q_bshd.dtype))
