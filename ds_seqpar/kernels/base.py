"""What every local attention kernel offers, and the autograd wrapper around it.

A kernel computes attention of one rank's query block against one key/value block and knows
nothing of ranks. Layouts (the legend used across ds_seqpar):

    q_bshd   [batch, seq_q, heads, head_dim]
    k_bshd   [batch, seq_k, kv_heads, head_dim]     kv_heads divides heads (GQA)
    v_bshd   [batch, seq_k, kv_heads, head_dim_v]
    out_bshd [batch, seq_q, heads, head_dim_v]      same dtype as q
    lse_bhs  [batch, heads, seq_q]                  fp32 log-sum-exp of the scaled scores

``causal`` means top-left aligned on a square block: query i sees keys j <= i. Ring strategies
only ever ask for causal on square blocks (the diagonal), so the kernels refuse other shapes
rather than pick an alignment silently; a kernel whose ``band_column`` is not None also takes tall
top-left causal blocks (seq_q >= seq_k: rows past seq_k see every key), which strategies/bands.py
then uses for sliding windows. ``anti`` (``block_forward``) is the mirror, query i sees keys
j >= i - (seq_q - seq_k) (j >= i on a square): the far edge of a sliding window. The default runs
it as a causal block on the reversed sequence (exact: a permutation of queries and keys); kernels
with a native window (flash-attn's window_size) override ``forward_block`` / ``backward_block``.

``softcap`` (Gemma 2): scores s = scale * q.k become softcap * tanh(s / softcap) before the softmax;
lse is that of the capped scores, and backward multiplies by the tanh's derivative.

``backward`` takes the *final* out and lse of the whole row (after merging all blocks); with
those, the per-block gradient formulas give exactly that block's share of dq, dk, dv.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch


class AttentionKernel:
    name = "base"

    def causal_tile(self, size: int, device) -> Optional[int]:
        """Tile to cut a causal square of ``size`` into (causal squares of the tile on the diagonal, full
        rectangles below), when the kernel wastes work on small causal blocks; None: call it whole.
        Packed documents use it (strategies/varlen.py): their causal squares are document-sized."""
        return None

    def band_column(self, width: int, device) -> Optional[int]:
        """Keys per column when a band of ``width`` diagonals (a sliding window) is cut into key tiles
        of tall causal / anti blocks (strategies/bands.py: band_columns); None: cut it by rows into
        squares and rectangles. A kernel returning a number must take tall top-left causal blocks."""
        return None

    def forward(self, q_bshd, k_bshd, v_bshd, causal: bool, scale: float,
                softcap: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal: bool, scale: float,
                 softcap: Optional[float] = None):
        raise NotImplementedError

    def forward_block(self, q_bshd, k_bshd, v_bshd, causal: bool, anti: bool, scale: float,
                      softcap: Optional[float] = None):
        """One sub-block (strategies/bands.py): full, causal or anti-causal."""
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


def check_block(q_bshd, k_bshd, v_bshd, causal: bool, tall: bool = False) -> None:
    """Shapes of one block; ``tall``: the kernel also takes top-left causal blocks with seq_q > seq_k."""
    if q_bshd.dim() != 4 or k_bshd.dim() != 4 or v_bshd.dim() != 4:
        raise ValueError(f"attention expects [batch, seq, heads, head_dim] tensors, got q {tuple(q_bshd.shape)}, "
                         f"k {tuple(k_bshd.shape)}, v {tuple(v_bshd.shape)}")
    check_head_groups(q_bshd.shape[2], k_bshd.shape[2])
    sq, sk = q_bshd.shape[1], k_bshd.shape[1]
    if causal and sq != sk and not (tall and sq > sk):
        raise ValueError(f"causal block must be square{' or tall' if tall else ''}, got seq_q={sq}, seq_k={sk}")


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
