"""Backward of the chunked linear-attention kernel (the maths and the phase contract are in
forward.py; shared layout, legend and scans in common.py).

Phases of one block's backward, so that a LASP rank can post its transfers before the bulk of the
work and receive the later ranks' gradient after it, with nothing computed twice:

    bwd = backward_begin(do, q, k, v, decay, chunk, state_in)   with state_in: the gradient reaching
                                    the state before each chunk (dh) and, walking it back to the block
                                    start, bwd.dstate_in; q and do only (~one bmm per head)
    backward_local(bwd)             chunk states (state_in folded in), then per head the intra-chunk
                                    dq, dk, dv and dq through the states (state_in's share included)
    backward_finish(bwd, dstate_local) -> (dq, dk, dv)   dstate_local (the gradient of the state after
                                    the block) joins the reverse walk over the chunks, and dk, dv
                                    through the states take it along: no separate pass over k and v
"""
from typing import Optional

import torch
from torch import Tensor

from .common import (Block, bmm_acc, chunk_products, chunked, fold_backward, head_slice, kv_of_state,
                     prepare_block, reduce_state, row_weighted, scan_states, scan_states_backward, state_dtype)


class BlockBackward:
    """One block's backward between its phases; dstate_in ([B, H, Dk, Dv], None without state_in) is
    the gradient of state_in through this block's outputs only (not through the state after it)."""

    def __init__(self, blk: Block, do_bnchd: Tensor, state_in_zbkv: Optional[Tensor]):
        self.blk, self.do, self.state_in = blk, do_bnchd, state_in_zbkv
        self.dh: Optional[Tensor] = None          # dh_zbnkv, once computed
        self.dnext: Optional[Tensor] = None       # its reverse walk without dstate_local (with state_in)
        self.dstate_in: Optional[Tensor] = None
        self.grads = None                         # (dq_bshd padded, dk_acc, dv_acc) after backward_local


def _state_grads(blk: Block, do_bnchd: Tensor) -> Tensor:
    """dh_zbnkv per q head (state_in is per q head): sum_i lambda^(i+1) q_i^T do_i over each chunk."""
    b, n, c, h, dk = blk.q.shape
    dh = blk.q.new_empty(h, b, n, dk, do_bnchd.shape[-1], dtype=state_dtype(blk.q.dtype))
    for qh in range(h):
        dod_mcd = row_weighted(blk, head_slice(do_bnchd, qh), do_bnchd, qh, True)
        bmm_acc(dh[qh].view(b * n, dk, -1), head_slice(blk.q, qh).transpose(1, 2), dod_mcd, True)
    return dh


def backward_begin(do_bshd, q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64,
                   state_in_bhkv: Optional[Tensor] = None) -> BlockBackward:
    """Phase 1: with state_in, dh and bwd.dstate_in (what a LASP rank sends to earlier ranks) from q
    and do alone; without, nothing yet (dh is then computed inside backward_local's head loop)."""
    blk = prepare_block(q_bshd, k_bshd, v_bshd, decay_h, chunk_size)
    do_bnchd, _ = chunked(do_bshd, blk.q.shape[2])
    if state_in_bhkv is None:
        return BlockBackward(blk, do_bnchd, None)
    bwd = BlockBackward(blk, do_bnchd, state_in_bhkv.to(state_dtype(q_bshd.dtype)).transpose(0, 1))
    bwd.dh = _state_grads(blk, do_bnchd)
    bwd.dnext, dstate_in_zbkv = scan_states_backward(blk, bwd.dh, None)
    bwd.dstate_in = dstate_in_zbkv.transpose(0, 1).contiguous()
    return bwd


def _backward_per_head(blk: Block, do_bnchd: Tensor, st: Optional[Tensor], dh: Optional[Tensor], with_state_in):
    """Per q head: dq (intra + through the states), dk/dv intra parts summed over each kv group in
    [Hkv, B*N, C, D] accumulators, and (into dh, when given) the gradient reaching each chunk's state."""
    b, n, c, h, dk = blk.q.shape
    dq = blk.q.new_empty(b, n * c, h, dk)
    dk_acc = blk.k.new_empty(blk.kv_heads, b * n, c, dk)
    dv_acc = blk.v.new_empty(blk.kv_heads, b * n, c, blk.v.shape[-1])
    for qh in range(h):
        kvh = qh // (h // blk.kv_heads)
        beta = 0.0 if qh % (h // blk.kv_heads) == 0 else 1.0          # first q head of its kv group
        q_mcd, k_mcd, v_mcd, do_mcd = (head_slice(x, i) for x, i in ((blk.q, qh), (blk.k, kvh), (blk.v, kvh),
                                                                 (do_bnchd, qh)))
        scores = torch.bmm(q_mcd, k_mcd.transpose(1, 2)).mul_(blk.mask[qh])      # recomputed, not saved
        dscores = torch.bmm(do_mcd, v_mcd.transpose(1, 2)).mul_(blk.mask[qh])
        dq_mcd = torch.bmm(dscores, k_mcd)
        dk_acc[kvh].baddbmm_(dscores.transpose(1, 2), q_mcd, beta=beta)
        dv_acc[kvh].baddbmm_(scores.transpose(1, 2), do_mcd, beta=beta)
        if st is not None or dh is not None:
            # lambda^(i+1) scales row i of do rather than q: it then serves both dq and dh
            dod_mcd = row_weighted(blk, do_mcd, do_bnchd, qh, with_state_in)
            if st is not None:
                zs = qh // (h // st.shape[0])
                dq_mcd.baddbmm_(dod_mcd, st[zs].view(b * n, dk, -1).to(dq.dtype).transpose(1, 2))
            if dh is not None:
                group = h // dh.shape[0]
                bmm_acc(dh[qh // group].view(b * n, dk, -1), q_mcd.transpose(1, 2), dod_mcd, qh % group == 0)
        dq[:, :, qh] = dq_mcd.view(b, n * c, dk)
    return dq, dk_acc, dv_acc


def backward_local(bwd: BlockBackward) -> None:
    """Phase 2, needs nothing from other blocks: the bulk of the work."""
    blk = bwd.blk
    b, n, c, _, dk = blk.q.shape
    with_state_in = bwd.state_in is not None
    st = scan_states(blk, chunk_products(blk), bwd.state_in)[0] if n > 1 or with_state_in else None
    new_dh = None
    if bwd.dh is None and n > 1:        # a single chunk's dh would feed only a state_in
        bwd.dh = new_dh = blk.q.new_empty(blk.state_heads, b, n, dk, blk.v.shape[-1], dtype=state_dtype(blk.q.dtype))
    bwd.grads = _backward_per_head(blk, bwd.do, st, new_dh, with_state_in)


def _dnext(bwd: BlockBackward, dstate_local_bhkv: Optional[Tensor]) -> Optional[Tensor]:
    """Gradient w.r.t. the state after each chunk, dstate_local included, over the block's state heads."""
    blk, heads = bwd.blk, bwd.blk.q.shape[3]
    z = blk.state_heads if bwd.dh is None else bwd.dh.shape[0]
    d_final = None if dstate_local_bhkv is None else reduce_state(dstate_local_bhkv, z, state_dtype(blk.q.dtype))
    if bwd.dnext is not None:                       # walked in phase 1, without dstate_local
        dnext = bwd.dnext if d_final is None else fold_backward(blk, bwd.dnext, d_final)
    elif bwd.dh is not None:
        dnext = scan_states_backward(blk, bwd.dh, d_final)[0]
    else:                                           # a single chunk: the state after it is the block's
        dnext = None if d_final is None else d_final.unsqueeze(2)
    if dnext is None or (blk.q.shape[1] == 1 and d_final is None):
        return None
    if dnext.shape[0] != blk.state_heads:           # per q head (state_in without decay): sum each kv group
        dnext = dnext.view(blk.state_heads, heads // blk.state_heads, *dnext.shape[1:]).sum(1)
    return dnext


def _backward_states(blk: Block, dnext: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
    """dk, dv of every key/value through the states after its chunk: dk_j += lambda^(C-1-j) v_j dS^T."""
    b, n, c, _, dk = blk.k.shape
    for hs in range(blk.state_heads):
        kvh = kv_of_state(blk, hs)
        k_mcd, v_mcd = head_slice(blk.k, kvh), head_slice(blk.v, kvh)
        if blk.k_out is not None:
            k_mcd, v_mcd = k_mcd * blk.k_out[hs], v_mcd * blk.k_out[hs]
        d_mkv = dnext[hs].view(b * n, dk, -1).to(k_mcd.dtype)
        dk_acc[kvh].baddbmm_(v_mcd, d_mkv.transpose(1, 2))
        dv_acc[kvh].baddbmm_(k_mcd, d_mkv)


def _unchunk(acc_zmcd: Tensor, b: int, pad: int) -> Tensor:
    z, m, c, d = acc_zmcd.shape
    return acc_zmcd.view(z, b, m // b * c, d).permute(1, 2, 0, 3)[:, pad:].contiguous()   # [B, S, Z, D]


def backward_finish(bwd: BlockBackward, dstate_local_bhkv: Optional[Tensor] = None):
    """Phase 3: (dq, dk, dv). dstate_local is the gradient of the state after the block (from later
    blocks); it costs one pass over the chunk states, not a pass over k and v."""
    blk = bwd.blk
    dq, dk_acc, dv_acc = bwd.grads
    dnext = _dnext(bwd, dstate_local_bhkv)
    if dnext is not None:
        _backward_states(blk, dnext, dk_acc, dv_acc)
    b = blk.q.shape[0]
    return dq[:, blk.pad:], _unchunk(dk_acc, b, blk.pad), _unchunk(dv_acc, b, blk.pad)


def chunked_backward(do_bshd, q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64,
                     state_in_bhkv=None, dstate_local_bhkv=None):
    """(dq, dk, dv, dstate_in) of chunked_forward, all phases in one call; dstate_in is None when
    state_in is None, and excludes the path through the state after the block (see BlockBackward)."""
    bwd = backward_begin(do_bshd, q_bshd, k_bshd, v_bshd, decay_h, chunk_size, state_in_bhkv)
    backward_local(bwd)
    return (*backward_finish(bwd, dstate_local_bhkv), bwd.dstate_in)


def intra_backward(do_bshd, q_bshd, k_bshd, v_bshd, decay_h=None, chunk_size=64, dstate_local_bhkv=None):
    """(dq, dk, dv) of intra_forward (no state_in); dstate_local is folded into the reverse chunk walk."""
    return chunked_backward(do_bshd, q_bshd, k_bshd, v_bshd, decay_h, chunk_size, None, dstate_local_bhkv)[:3]
