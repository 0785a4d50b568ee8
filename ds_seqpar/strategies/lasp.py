"""LASP: causal linear attention over a sequence split contiguously: rank r holds tokens [r*L, (r+1)*L).

Notation: P ranks in the sequence group, r = this rank, L local tokens (the same on every rank),
B batch, H q heads (Hkv k/v heads, GQA), Dk, Dv head dims, lambda_h the fixed per-head decay (1
without). States are [B, H, Dk, Dv] in fp32 (fp64 for fp64 inputs), one per q head.

    o_t        = q_t . sum_{s<=t} lambda^(t-s) k_s^T v_s             over the WHOLE sequence
    S_r        = sum_{s in rank r} lambda^(L-1-s) k_s^T v_s             this rank's state_local
    state_in_r = sum_{r'<r} lambda^(L (r-1-r')) S_r'                    (0 on rank 0)
               = lambda^L state_in_{r-1} + S_{r-1}                      the ring recurrence

Math -> code (kernels in linear_attention.py; they know nothing of ranks):

    o_r        = intra_forward(q, k, v)  +  state_output(q, state_in_r)
    dq         = intra_backward's dq     +  state_output_backward's dq
    G_r        = state_output_backward's dstate_in   (needs only q and do)
    dS_r       = sum_{r'>r} lambda^(L (r'-1-r)) G_r'                    (0 on the last rank)
    dk, dv     = intra_backward's        +  state_local_backward(k, v, dS_r)

How states travel is kept apart from what is computed on them (two exchange classes):

- lasp_comm "ring" (LASP-1). Forward: rank r receives state_in from r-1 and forwards
  lambda^L state_in + S_r to r+1: P-1 sequential hops. Backward walks the ring in reverse:
  dstate flows from r+1 to r; rank r receives D_{r+1} (= dS_r, the gradient of the state it sent)
  and forwards D_r = G_r + lambda^L D_{r+1} to r-1.
- lasp_comm "allgather" (LASP-2). Forward: all-gather every S_r', then a local decay-weighted
  prefix sum. Backward is the dual collective: rank r puts lambda^(L (r-1-r')) G_r in slot r' < r
  of a [P, B, H, Dk, Dv] buffer and a reduce-scatter hands each rank the sum for its own S.

Overlap (ctx.overlap): the intra-block work never waits for a state. Forward posts the state
transfer first (S_r from k and v alone, a cheap matmul, where it must leave before the intra
work: rank 0 on the ring, ranks < P-1 for the all-gather), runs intra_forward, then waits and
adds state_output; backward computes G_r first, posts its transfer, runs intra_backward, then
waits and adds state_local_backward. Middle ring ranks can only forward a state once it arrived,
so they do it after their intra work. Without overlap every transfer is waited for as soon as it
is posted; the kernel calls are the same, so both give bit-identical results. Values nobody reads
are not computed: the last rank's S (the all-gather still carries it: zeros), rank 0's G.

Bytes sent per rank, one forward + backward; state_bytes = B*H*Dk*Dv*4 (8 for fp64 inputs):

    ring:       state_bytes * ([r < P-1] + [r > 0])      one state forward, one dstate backward
    allgather:  state_bytes * 2 * (P-1)                  all-gather (P-1); reduce-scatter (P-1)/P of P
None of it depends on L: LASP's communication does not grow with the sequence.

Constraints: every rank holds L tokens (contiguous layout); GQA native (states are per q head, so
H states travel even when kv heads share one without decay); decay None or a fixed [H] tensor in
(0, 1] (checked before any communication).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import comm
from ..linear_attention import (check_inputs, intra_backward, intra_forward, state_decay, state_dtype, state_local,
                                state_local_backward, state_output, state_output_backward)
from .base import Strategy

CHUNK_SIZE = 64          # the kernel's chunk, as single-process linear_attention uses


def _decayed(decay_h11: Optional[Tensor], state_bhkv: Tensor) -> Tensor:
    """lambda^n * state, where decay_h11 = lambda^n per head as [H, 1, 1] (None: no decay)."""
    return state_bhkv if decay_h11 is None else state_bhkv * decay_h11


class _States:
    """What both exchanges share: who this rank is, the state shape, lambda^(L n), and posting
    that waits at once without overlap."""

    def __init__(self, ctx, q_bshd: Tensor, v_bshd: Tensor, decay_h: Optional[Tensor]):
        self.p, self.r, self.group, self.stats, self.overlap = (ctx.sp_size, ctx.sp_rank, ctx.sp_group, ctx.stats,
                                                                 ctx.overlap)
        b, self.length, self.heads, dk = q_bshd.shape
        self.shape, self.dtype = (b, self.heads, dk, v_bshd.shape[-1]), state_dtype(q_bshd.dtype)
        self.device = q_bshd.device
        self.decay_h = decay_h

    def power(self, n: int) -> Optional[Tensor]:
        """lambda^(L n) as [H, 1, 1]: carries a state across n whole ranks."""
        return state_decay(self.decay_h, self.length * n, self.dtype)

    def empty(self, *lead: int) -> Tensor:
        return torch.empty(lead + self.shape, dtype=self.dtype, device=self.device)

    def zeros(self, *lead: int) -> Tensor:
        return torch.zeros(lead + self.shape, dtype=self.dtype, device=self.device)

    def posted(self, pending):
        if not self.overlap:
            pending.wait()
        return pending


class _RingStates(_States):
    """LASP-1: a state hops r-1 -> r -> r+1; backward walks the ring in reverse (r+1 -> r)."""

    _recv = _send = None

    def _p2p(self, sends, recvs, kind):
        return self.posted(comm.p2p(sends, recvs, self.group, self.stats, kind))

    def post_state(self, k_bshd: Tensor, v_bshd: Tensor) -> None:
        if self.r > 0:
            self._recv = self._p2p([], [(self.empty(), self.r - 1)], "lasp_state")
        elif self.p > 1:       # rank 0's outgoing state is its own S: send it before the intra work
            self._send = self._p2p([(state_local(k_bshd, v_bshd, self.heads, self.decay_h), 1)], [], "lasp_state")

    def state_in(self, own_state: Tensor) -> Optional[Tensor]:
        if self.r == 0:
            return None
        state_in = self._recv.wait()[0]
        if self.r < self.p - 1:
            self._send = self._p2p([(_decayed(self.power(1), state_in) + own_state, self.r + 1)], [], "lasp_state")
        return state_in

    def post_dstate(self, dstate_in: Optional[Tensor]) -> None:
        if self.r < self.p - 1:
            self._recv = self._p2p([], [(self.empty(), self.r + 1)], "lasp_dstate")
        elif self.r > 0:       # the last rank's D is its own G: send it before the intra work
            self._send = self._p2p([(dstate_in, self.r - 1)], [], "lasp_dstate")

    def dstate_local(self, dstate_in: Optional[Tensor]) -> Optional[Tensor]:
        if self.r == self.p - 1:
            return None
        d_after = self._recv.wait()[0]          # D_{r+1}: the gradient of the state sent to r+1
        if self.r > 0:
            self._send = self._p2p([(dstate_in + _decayed(self.power(1), d_after), self.r - 1)], [], "lasp_dstate")
        return d_after

    def finish(self) -> None:
        if self._send is not None:              # sends complete before their buffers go
            self._send.wait()
        self._send = self._recv = None


class _GatheredStates(_States):
    """LASP-2: all-gather every S, prefix-sum locally; backward reduce-scatters the dual."""

    _pending = None

    def post_state(self, k_bshd: Tensor, v_bshd: Tensor) -> None:
        # prefix sums only look back: the last rank's S is never read, so it contributes zeros
        own = state_local(k_bshd, v_bshd, self.heads, self.decay_h) if self.r < self.p - 1 else self.zeros()
        self._pending = self.posted(comm.all_gather_async(own, self.group, self.stats, "lasp_state"))

    def state_in(self, own_state: Tensor) -> Optional[Tensor]:
        states = self._pending.wait()           # [S_0, ..., S_{P-1}], each [B, H, Dk, Dv]
        if self.r == 0:
            return None
        return sum(_decayed(self.power(self.r - 1 - src), states[src]) for src in range(self.r))

    def post_dstate(self, dstate_in: Optional[Tensor]) -> None:
        to_owner_pbhkv = self.zeros(self.p)     # slot r': this rank's share of dS_r'
        for dst in range(self.r):
            to_owner_pbhkv[dst] = _decayed(self.power(self.r - 1 - dst), dstate_in)
        self._pending = self.posted(comm.reduce_scatter_async(to_owner_pbhkv, 0, self.group, self.stats,
                                                              "lasp_dstate"))

    def dstate_local(self, dstate_in: Optional[Tensor]) -> Optional[Tensor]:
        d_own = self._pending.wait()[0]         # [1, B, H, Dk, Dv] summed over ranks -> [B, H, Dk, Dv]
        return None if self.r == self.p - 1 else d_own

    def finish(self) -> None:
        self._pending = None


EXCHANGES = {"ring": _RingStates, "allgather": _GatheredStates}


def _exchange(ctx, q_bshd, v_bshd, decay_h) -> _States:
    return EXCHANGES[ctx.lasp_comm](ctx, q_bshd, v_bshd, decay_h)


# ---------------------------------------------------------------------------------------------
# forward and backward


def lasp_forward(q_bshd, k_bshd, v_bshd, decay_h, ctx, chunk_size=CHUNK_SIZE) -> Tuple[Tensor, Optional[Tensor]]:
    """(o_bshd, state_in_bhkv or None on rank 0) of this rank's block of the whole sequence."""
    check_inputs(q_bshd, k_bshd, v_bshd, decay_h)      # the same error on every rank, before any transfer
    states = _exchange(ctx, q_bshd, v_bshd, decay_h)
    states.post_state(k_bshd, v_bshd)
    o_bshd, own_state = intra_forward(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)   # while states travel
    state_in = states.state_in(own_state)
    if state_in is not None:
        state_output(q_bshd, state_in, decay_h, out=o_bshd)
    states.finish()
    return o_bshd, state_in


def lasp_backward(do_bshd, q_bshd, k_bshd, v_bshd, state_in, decay_h, ctx, chunk_size=CHUNK_SIZE):
    """(dq, dk, dv) of lasp_forward; dstates flow towards earlier ranks (see the module doc)."""
    do_bshd = do_bshd.contiguous()
    dq_state, dstate_in = (None, None) if state_in is None else \
        state_output_backward(do_bshd, q_bshd, state_in, decay_h)                    # G_r: q and do only
    states = _exchange(ctx, q_bshd, v_bshd, decay_h)
    states.post_dstate(dstate_in)
    dq, dk, dv = intra_backward(do_bshd, q_bshd, k_bshd, v_bshd, decay_h, chunk_size)   # while dstates travel
    dstate_local = states.dstate_local(dstate_in)
    if dstate_local is not None:
        dk_state, dv_state = state_local_backward(k_bshd, v_bshd, dstate_local, decay_h)
        dk += dk_state
        dv += dv_state
    if dq_state is not None:
        dq += dq_state
    states.finish()
    return dq, dk, dv


class LaspFunction(torch.autograd.Function):
    """Thin: save what backward needs, call the plain functions. decay gets no gradient."""

    @staticmethod
    def forward(fctx, q_bshd, k_bshd, v_bshd, decay_h, ctx):
        o_bshd, state_in = lasp_forward(q_bshd, k_bshd, v_bshd, decay_h, ctx)
        fctx.save_for_backward(q_bshd, k_bshd, v_bshd, state_in)
        fctx.decay_h, fctx.ctx = decay_h, ctx
        return o_bshd

    @staticmethod
    def backward(fctx, do_bshd):
        q_bshd, k_bshd, v_bshd, state_in = fctx.saved_tensors
        dq, dk, dv = lasp_backward(do_bshd, q_bshd, k_bshd, v_bshd, state_in, fctx.decay_h, fctx.ctx)
        return dq, dk, dv, None, None


def lasp_attention(q_bshd, k_bshd, v_bshd, decay_h, ctx) -> Tensor:
    """Differentiable causal linear attention of this rank's block over the whole sequence."""
    return LaspFunction.apply(q_bshd, k_bshd, v_bshd, decay_h, ctx)


class LaspAttention(Strategy):
    """sp.linear_attention via LASP; sp.attention raises (Strategy base) and names the fix."""

    name = "lasp"
    layout_name = "contiguous"

    def linear_attention(self, q_bshd, k_bshd, v_bshd, decay: Optional[Tensor]) -> Tensor:
        return lasp_attention(q_bshd, k_bshd, v_bshd, decay, self.ctx)
