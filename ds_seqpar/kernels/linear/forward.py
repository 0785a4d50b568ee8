"""Chunked causal linear attention with optional per-head decay: the forward phases and the entry point.

    o_t = q_t . sum_{s<=t} lambda^(t-s) k_s^T v_s       per batch and q head; no normalisation and
                                                          no feature map (the layer applies those)
Layouts and the chunk scans are in common.py (legend there), the backward in backward.py, the
plain quadratic reference in naive.py; this module holds the forward phases and the entry point.

Block decomposition the LASP strategy relies on (t = local position, S = block length):
    o_t         = intra(q, k, v)_t + lambda^(t+1) q_t . state_in
    state_local = sum_s lambda^(S-1-s) k_s^T v_s  (excludes state_in)
    state after the block = lambda^S state_in + state_local              (state_decay gives lambda^S)
Inside a block of N chunks of C tokens, the kernel needs each chunk's own k^T v (kv) anyway; their
prefix scan gives the state before each chunk (st) and, at the end, the state after the block. A
state_in is folded into that scan (it starts the walk), so its share of o costs nothing beyond the
q . st product every chunk already has. The phases let a LASP rank overlap without duplicated work:

    fwd = forward_begin(q, k, v)    each chunk's kv (phase 1, the chunk products the kernel needs)
    forward_states(fwd)             their scan: state_local, to send before the intra work
    forward_diagonal(fwd)           intra-chunk masked attention: needs no state
    forward_states(fwd, state_in)   state_in joins the scan (one vectorized pass over st when the scan
                                    already ran); returns lambda^S state_in + state_local
    forward_finish(fwd) -> o        q . st per chunk (+ the diagonal part, if not done yet)

and in backward (backward.py) backward_begin gives dstate_in from q and do alone,
backward_local does the bulk, and backward_finish folds the later ranks' dstate_local into the
reverse chunk walk. chunked_forward / chunked_backward run all phases in one call; intra_* are
them without state_in (single-process linear_attention is intra_forward + intra_backward).
Work is a Python loop over heads of batched matmuls on strided per-head views: no layout copies of
q/k/v, K/V never repeated for GQA, and one head's working set stays in cache. Forward and backward
are explicit functions; LinearAttentionFunction only saves tensors and calls them. Powers of lambda
are exp(n log lambda) with n >= 0, so nothing is ever divided by a tiny power.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .backward import intra_backward
from .common import (Block, chunk_products, expand_state, fold_state, head_slice, prepare_block, row_weighted,
                     scan_states, state_dtype)


class BlockForward:
    """One block's forward between its phases (see the module doc)."""

    def __init__(self, blk: Block, kv_zbnkv: Tensor):
        self.blk, self.kv = blk, kv_zbnkv
        self.st: Optional[Tensor] = None          # st_zbnkv once scanned
        self.final: Optional[Tensor] = None       # state after the block [Z, B, Dk, Dv] once scanned
        self.with_state_in = False
        self.o: Optional[Tensor] = None           # [B, N*C, H, Dv] holding the diagonal part, once computed


def forward_begin(q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64) -> BlockForward:
    """Phase 1: checks, chunking and each chunk's own decayed k^T v. Needs nothing from other blocks."""
    blk = prepare_block(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
    return BlockForward(blk, chunk_products(blk))


def forward_states(fwd: BlockForward, state_in_bhkv: Optional[Tensor] = None) -> Tensor:
    """The state after the block, [B, H, Dk, Dv]: lambda^S state_in + state_local (state_local alone
    without state_in). Called once, or first without state_in (to send state_local early) and again
    with it, when state_in is folded into the first call's chunk states."""
    if fwd.with_state_in:
        raise RuntimeError("forward_states: state_in was already folded into this block")
    blk = fwd.blk
    init = None if state_in_bhkv is None else \
        state_in_bhkv.to(state_dtype(blk.q.dtype)).transpose(0, 1)            # [H, B, Dk, Dv]
    if fwd.st is None:
        fwd.st, fwd.final = scan_states(blk, fwd.kv, init)
        fwd.kv = None                             # the scan wrote st over it
    elif init is not None:
        fwd.st, fwd.final = fold_state(blk, fwd.st, fwd.final, init)
    fwd.with_state_in = init is not None
    return expand_state(fwd.final, blk.q.shape[3])


def _diagonal(blk: Block, qh: int) -> Tensor:
    """Intra-chunk part of head qh, (q k^T * mask) v per chunk, as [B*N, C, Dv]."""
    kvh = qh // (blk.q.shape[3] // blk.kv_heads)
    scores = torch.bmm(head_slice(blk.q, qh), head_slice(blk.k, kvh).transpose(1, 2)).mul_(blk.mask[qh])
    return torch.bmm(scores, head_slice(blk.v, kvh))


def forward_diagonal(fwd: BlockForward) -> None:
    """The intra-chunk work of every head, ahead of forward_finish (e.g. while a state_in travels),
    written straight into o: a separate buffer would be one more large allocation to fault in."""
    b, n, c, h, _ = fwd.blk.q.shape
    fwd.o = fwd.blk.q.new_empty(b, n * c, h, fwd.blk.v.shape[-1])
    for qh in range(h):
        fwd.o[:, :, qh] = _diagonal(fwd.blk, qh).view(b, n * c, -1)


def forward_finish(fwd: BlockForward) -> Tensor:
    """o_bshd: per head, the diagonal part plus earlier chunks (and state_in) through q . st."""
    if fwd.st is None:
        forward_states(fwd)
    blk, st = fwd.blk, fwd.st
    b, n, c, h, dk = blk.q.shape
    split = fwd.o is not None                            # forward_diagonal ran
    o = fwd.o if split else blk.q.new_empty(b, n * c, h, blk.v.shape[-1])
    for qh in range(h):
        o_mcd = o[:, :, qh].view(b * n, c, -1) if split else _diagonal(blk, qh)
        if n > 1 or fwd.with_state_in:                   # chunk 0's own st is 0
            qd_mcd = row_weighted(blk, head_slice(blk.q, qh), blk.q, qh, fwd.with_state_in)
            o_mcd.baddbmm_(qd_mcd, st[qh // (h // st.shape[0])].view(b * n, dk, -1).to(o.dtype))
        if not split:
            o[:, :, qh] = o_mcd.view(b, n * c, -1)
    return o[:, blk.pad:]


def chunked_forward(q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64, state_in_bhkv=None):
    """(o_bshd, state after the block) given the state of all earlier tokens (or None), in one call."""
    fwd = forward_begin(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
    state_after = forward_states(fwd, state_in_bhkv)
    return forward_finish(fwd), state_after


def intra_forward(q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64) -> Tuple[Tensor, Tensor]:
    """This block alone (as if state_in = 0): (o_bshd, state_local_bhkv)."""
    return chunked_forward(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)


# ----------------------------------------------------------------------------- autograd and entry point
class LinearAttentionFunction(torch.autograd.Function):
    """Single-process causal linear attention; saves q, k, v only (chunk states are recomputed)."""

    @staticmethod
    def forward(ctx, q_bshd, k_bshd, v_bshd, decay_h, chunk_size):
        o, _ = intra_forward(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
        ctx.save_for_backward(q_bshd, k_bshd, v_bshd)
        ctx.decay_h, ctx.chunk_size = decay_h, chunk_size
        return o

    @staticmethod
    def backward(ctx, do_bshd):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = intra_backward(do_bshd, q, k, v, ctx.decay_h, ctx.chunk_size)
        return dq, dk, dv, None, None


def linear_attention(q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64) -> Tensor:
    """Causal linear attention over the whole sequence on one process: O(S*C*D + S*D^2)."""
    return LinearAttentionFunction.apply(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
