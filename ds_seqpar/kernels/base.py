"""What every local attention kernel offers, and the autograd wrapper around it.

A kernel computes attention of one rank's query block against one key/value block and knows
nothing of ranks. Layouts (the legend used across ds_seqpar):

    q_bshd   [batch, seq_q, heads, head_dim]
    k_bshd   [batch, seq_k, kv_heads, head_dim]     kv_heads divides heads (GQA)
    v_bshd   [batch, seq_k, kv_heads, head_dim_v]
    out_bshd [batch, seq_q, heads, head_dim_v]      same dtype as q
    lse_bhs  [batch, heads, seq_q]                  fp32 log-sum-exp of the scaled scores

The strategies call ``band`` / ``band_backward``: the queries against the keys between two diagonal
offsets, key j visible to query i iff lo <= j - i <= hi (None: unbounded; causal = (None, 0), a
sliding window's edge lo = 1 - w; bands.py). Every row of a band sees at least one key (the plans
trim them so). The default cuts the band into full, causal and anti-causal sub-blocks
(``pieces``: bands.py's cutter) and merges their (out, lse); a kernel may cut differently (the torch
kernel's CPU tiles and key columns) or compute a band in one call (flash-attn's window_size). The ring
loop passes its own fp32 accumulators (``into``: merge.Merge / merge.Sum views of the band's rows and
keys), so pieces fold straight in: no band-sized buffer, no second pass.

``causal`` (``forward``) means top-left aligned on a square block: query i sees keys j <= i; the
kernels refuse other shapes rather than pick an alignment silently. ``anti`` (``forward_block``)
is the mirror, query i sees keys j >= i - (seq_q - seq_k) (j >= i on a square): the far edge of a
sliding window. The default runs it as a causal block on the reversed sequence (exact: a permutation
of queries and keys).

``softcap`` (Gemma 2): scores s = scale * q.k become softcap * tanh(s / softcap) before the softmax;
lse is that of the capped scores, and backward multiplies by the tanh's derivative.

``backward`` takes the *final* out and lse of the whole row (after merging all blocks); with
those, the per-block gradient formulas give exactly that block's share of dq, dk, dv.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from .bands import SubBlock, band_blocks
from .merge import Merge, Sum


class AttentionKernel:
    name = "base"

    def pieces(self, nq: int, nk: int, lo: Optional[int], hi: Optional[int], device) -> List[SubBlock]:
        """The sub-blocks the default ``band`` computes a band of nq x nk in: bands.py's cut into
        squares and rectangles."""
        return band_blocks(0, nq, 0, nk, lo, hi)

    def band(self, q_bshd, k_bshd, v_bshd, lo: Optional[int], hi: Optional[int], scale: float,
             softcap: Optional[float] = None, into: Optional[Merge] = None):
        """(out_bshd, lse_bhs fp32) of every query against the keys of its band (module doc), fp32; or,
        with ``into`` (the caller's accumulators of these rows, merge.py), folded into it: None."""
        acc = Merge.empty(q_bshd, v_bshd.shape[-1]) if into is None else into
        for s in self.pieces(q_bshd.shape[1], k_bshd.shape[1], lo, hi, q_bshd.device):
            out, lse = self.forward_block(q_bshd[:, s.q], k_bshd[:, s.k], v_bshd[:, s.k], s.causal, s.anti, scale,
                                          softcap)
            acc.fold_(s.q, out, lse)
        return (acc.out, acc.lse) if into is None else None

    def band_backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, lo: Optional[int],
                      hi: Optional[int], scale: float, softcap: Optional[float] = None,
                      into: Optional[Tuple[Sum, Sum, Sum]] = None):
        """(dq, dk, dv) fp32 of a band, given its rows' final out and lse (every block merged); or, with
        ``into`` (the caller's sums of these rows and keys, merge.py), added into them: None."""
        sums = tuple(Sum.empty(t) for t in (q_bshd, k_bshd, v_bshd)) if into is None else into
        for s in self.pieces(q_bshd.shape[1], k_bshd.shape[1], lo, hi, q_bshd.device):
            g = self.backward_block(dout_bshd[:, s.q], q_bshd[:, s.q], k_bshd[:, s.k], v_bshd[:, s.k],
                                    out_bshd[:, s.q], lse_bhs[:, :, s.q], s.causal, s.anti, scale, softcap)
            for acc, tokens, x in zip(sums, (s.q, s.k, s.k), g):
                acc.add_(tokens, x)
        return tuple(acc.total() for acc in sums) if into is None else None

    def forward(self, q_bshd, k_bshd, v_bshd, causal: bool, scale: float,
                softcap: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal: bool, scale: float,
                 softcap: Optional[float] = None):
        raise NotImplementedError

    def forward_block(self, q_bshd, k_bshd, v_bshd, causal: bool, anti: bool, scale: float,
                      softcap: Optional[float] = None):
        """One sub-block (kernels/bands.py): full, causal or anti-causal."""
        if not anti:
            return self.forward(q_bshd, k_bshd, v_bshd, causal, scale, softcap)
        out_bshd, lse_bhs = self.forward(*_reversed(q_bshd, k_bshd, v_bshd), True, scale, softcap)
        return reverse_tokens(out_bshd), reverse_tokens(lse_bhs, -1)

    def backward_block(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal: bool, anti: bool,
                       scale: float, softcap: Optional[float] = None):
        if not anti:
            return self.backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale, softcap)
        grads = self.backward(*_reversed(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd), reverse_tokens(lse_bhs, -1),
                              True, scale, softcap)
        return _reversed(*grads)


def reverse_tokens(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``x`` with dimension ``dim`` (the tokens) reversed. A gather of whole rows: on CPU ``flip`` of a
    middle dimension is several times slower, which a window's many anti blocks pay for."""
    return x.index_select(dim, _backwards(x.shape[dim], x.device))


@functools.lru_cache(maxsize=64)
def _backwards(n: int, device) -> torch.Tensor:
    return torch.arange(n - 1, -1, -1, device=device)


def _reversed(*tensors_bshd):
    """The same tokens in reverse order: an anti-causal block becomes a causal one."""
    return tuple(reverse_tokens(t) for t in tensors_bshd)


def check_head_groups(num_heads: int, num_kv_heads: int, where: str = "") -> None:
    """GQA: every k/v head serves the same number of q heads. The one statement of that rule:
    SequenceParallel's input checks, the kernels, Ulysses and the benchmark's options call it."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{where}q heads ({num_heads}) must be a multiple of k/v heads ({num_kv_heads})")


def check_block(q_bshd, k_bshd, v_bshd, causal: bool) -> None:
    """Shapes of one block: 4-D, GQA groups, a causal block square."""
    if q_bshd.dim() != 4 or k_bshd.dim() != 4 or v_bshd.dim() != 4:
        raise ValueError(f"attention expects [batch, seq, heads, head_dim] tensors, got q {tuple(q_bshd.shape)}, "
                         f"k {tuple(k_bshd.shape)}, v {tuple(v_bshd.shape)}")
    check_head_groups(q_bshd.shape[2], k_bshd.shape[2])
    sq, sk = q_bshd.shape[1], k_bshd.shape[1]
    if causal and sq != sk:
        raise ValueError(f"causal block must be square, got seq_q={sq}, seq_k={sk}")


class LocalAttention(torch.autograd.Function):
    """Thin autograd wrapper: save what backward needs, call the kernel."""

    @staticmethod
    def forward(ctx, q_bshd, k_bshd, v_bshd, kernel: AttentionKernel, causal: bool, scale: float):
        out_bshd, lse_bhs = kernel.forward(q_bshd, k_bshd, v_bshd, causal, scale)
        ctx.save_for_backward(q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs)
        ctx.kernel, ctx.causal, ctx.scale = kernel, causal, scale
        return out_bshd

    @staticmethod
    def backward(ctx, dout_bshd):
        q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout_bshd.contiguous(), q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs,
                                         ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def local_attention(q_bshd, k_bshd, v_bshd, kernel: AttentionKernel, causal: bool, scale: float):
    return LocalAttention.apply(q_bshd, k_bshd, v_bshd, kernel, causal, scale)
