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

How states travel is kept apart from what is computed on them (two exchange classes):

- lasp_comm "ring" (LASP-1). Forward: rank r receives state_in from r-1 and forwards
  lambda^L state_in + S_r to r+1: P-1 sequential hops. Backward walks the ring in reverse:
  dstate flows from r+1 to r; rank r receives D_{r+1} (= dS_r, the gradient of the state it sent)
  and forwards D_r = G_r + lambda^L D_{r+1} to r-1.
- lasp_comm "allgather" (LASP-2). Forward: all-gather every S_r', then a local decay-weighted
  prefix sum. Backward is the dual collective: rank r puts lambda^(L (r-1-r')) G_r in slot r' < r
  of a [P, B, H, Dk, Dv] buffer and a reduce-scatter hands each rank the sum for its own S.

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
from ..kernels.linear import (backward_begin, backward_finish, backward_local, check_inputs, forward_begin,
                                forward_diagonal, forward_finish, forward_states, state_decay, state_dtype)
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

    @property
    def receives_state(self) -> bool:
        return self.r > 0                      # rank 0 has no earlier tokens

    def posted(self, pending):
        if not self.overlap:
            pending.wait()
        return pending


class _RingStates(_States):
    """LASP-1: a state hops r-1 -> r -> r+1; backward walks the ring in reverse (r+1 -> r)."""

    _recv = _send = None

    def _p2p(self, sends, recvs, kind):
        return self.posted(comm.p2p(sends, recvs, self.group, self.stats, kind))

    @property
    def sends_local_state(self) -> bool:
        return self.r == 0 and self.p > 1      # rank 0's outgoing state is its own S

    def post_state(self, local_state: Optional[Tensor]) -> None:
        if self.r > 0:
            self._recv = self._p2p([], [(self.empty(), self.r - 1)], "lasp_state")
        elif self.p > 1:
            self._send = self._p2p([(local_state, 1)], [], "lasp_state")

    def state_in(self) -> Optional[Tensor]:
        return None if self.r == 0 else self._recv.wait()[0]

    def pass_on(self, state_after: Tensor) -> None:
        """Middle ranks forward lambda^L state_in + S_r, the state after their block, to r+1."""
        if 0 < self.r < self.p - 1:
            self._send = self._p2p([(state_after, self.r + 1)], [], "lasp_state")

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

    @property
    def sends_local_state(self) -> bool:
        return self.r < self.p - 1             # prefix sums only look back: the last S is never read

    def post_state(self, local_state: Optional[Tensor]) -> None:
        own = local_state if self.sends_local_state else self.zeros()
        self._pending = self.posted(comm.all_gather_async(own, self.group, self.stats, "lasp_state"))

    def state_in(self) -> Optional[Tensor]:
        states = self._pending.wait()           # [S_0, ..., S_{P-1}], each [B, H, Dk, Dv]
        if self.r == 0:
            return None
        return sum(_decayed(self.power(self.r - 1 - src), states[src]) for src in range(self.r))

    def pass_on(self, state_after: Tensor) -> None:
        pass                                    # every S already went out with the all-gather

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
    fwd = forward_begin(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)     # each chunk's k^T v
    states.post_state(forward_states(fwd) if states.sends_local_state else None)   # S_r: their scan
    state_in = None
    if states.receives_state:
        forward_diagonal(fwd)                           # the intra-chunk work, while states travel
        state_in = states.state_in()
        states.pass_on(forward_states(fwd, state_in))   # state_in joins the chunk-state scan
    o_bshd = forward_finish(fwd)                        # q . (chunk states), state_in's share included
    states.finish()
    return o_bshd, state_in


def lasp_backward(do_bshd, q_bshd, k_bshd, v_bshd, state_in, decay_h, ctx, chunk_size=CHUNK_SIZE):
    """(dq, dk, dv) of lasp_forward; dstates flow towards earlier ranks (see the module doc)."""
    bwd = backward_begin(do_bshd.contiguous(), q_bshd, k_bshd, v_bshd, decay_h, chunk_size, state_in)
    states = _exchange(ctx, q_bshd, v_bshd, decay_h)
    states.post_dstate(bwd.dstate_in)                   # G_r: from q and do alone (None on rank 0)
    backward_local(bwd)                                 # the bulk, while dstates travel
    dq, dk, dv = backward_finish(bwd, states.dstate_local(bwd.dstate_in))   # dS_r joins the reverse walk
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
