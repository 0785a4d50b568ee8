"""Dao-AILab flash-attn (CUDA only), through its lse-returning internal entry points.

flash-attn aligns a causal mask bottom-right when seq_q != seq_k; ds_seqpar only asks for causal
on square blocks, where both alignments agree (``check_block`` enforces it). GQA is native.

flash-attn 2.x (>= 2.7: split window sizes, four return values) entry points, as its flash_attn_interface defines them:
    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                        softcap, alibi_slopes, return_softmax) -> (out, softmax_lse [b, h, s] fp32, S_dmask, rng_state)
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state)
Its window: query i sees keys j in [i + sk - sq - left, i + sk - sq + right] (-1 = unbounded). So a
band (base.py: lo <= j - i <= hi) is ONE call with left = sk - sq - lo and right = hi - (sk - sq)
(flash-attn itself treats (-1, 0) on a square as causal), and an anti-causal square (query i sees
j >= i) is window (0, -1), with no reversal; a band whose offsets no window can state (a negative
left or right) takes the default cut. Softcap is its own argument (0.0 = off). flash-attn reads softmax_lse as a dense [b, h, sq] array
and refuses head dims that are not a multiple of 8: a sub-block's lse slice is made contiguous,
and q/k/v are zero-padded to a multiple of 8 (exact: zero columns add nothing to q.k with the scale
passed explicitly, and zero columns of v give output columns that are cropped). tests/unit/test_flash_attn_conformance.py checks these calls
against a CPU stand-in written from that documentation (no GPU is lent to this project).
"""
import torch

from .base import AttentionKernel, check_block


def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class FlashAttnKernel(AttentionKernel):
    name = "flash_attn"

    def __init__(self):
        from flash_attn import flash_attn_interface as fa
        self._fa = fa

    def forward(self, q_bshd, k_bshd, v_bshd, causal, scale, softcap=None):
        return self.forward_block(q_bshd, k_bshd, v_bshd, causal, False, scale, softcap)

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale, softcap=None):
        return self.backward_block(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, False, scale,
                                   softcap)

    def forward_block(self, q_bshd, k_bshd, v_bshd, causal, anti, scale, softcap=None):
        check_block(q_bshd, k_bshd, v_bshd, causal or anti)
        return self._forward(q_bshd, k_bshd, v_bshd, causal, (0, -1) if anti else (-1, -1), scale, softcap)

    def backward_block(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, anti, scale,
                       softcap=None):
        return self._backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal,
                              (0, -1) if anti else (-1, -1), scale, softcap)

    def band(self, q_bshd, k_bshd, v_bshd, lo, hi, scale, softcap=None, into=None):
        window = _window(q_bshd.shape[1], k_bshd.shape[1], lo, hi)
        if window is None:
            return super().band(q_bshd, k_bshd, v_bshd, lo, hi, scale, softcap, into)
        out, lse = self._forward(q_bshd, k_bshd, v_bshd, False, window, scale, softcap)
        if into is None:
            return out, lse
        into.fold_(slice(None), out, lse)
        return None

    def band_backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, lo, hi, scale, softcap=None,
                      into=None):
        window = _window(q_bshd.shape[1], k_bshd.shape[1], lo, hi)
        if window is None:
            return super().band_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, lo, hi, scale, softcap,
                                         into)
        grads = self._backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, False, window, scale, softcap)
        if into is None:
            return grads
        for acc, g in zip(into, grads):
            acc.add_(slice(None), g)
        return None

    def _forward(self, q_bshd, k_bshd, v_bshd, causal, window, scale, softcap):
        dv = v_bshd.shape[-1]
        q_bshd, k_bshd, v_bshd = (_pad8(t) for t in (q_bshd, k_bshd, v_bshd))
        res = self._fa._flash_attn_forward(q_bshd, k_bshd, v_bshd, 0.0, scale, causal=causal,
                                           window_size_left=window[0], window_size_right=window[1],
                                           softcap=0.0 if softcap is None else float(softcap),
                                           alibi_slopes=None, return_softmax=False)
        return res[0].narrow(-1, 0, dv), res[1].float()      # narrow: traceable on fake CUDA tensors too

    def _backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, window, scale, softcap):
        d, dv_width = q_bshd.shape[-1], v_bshd.shape[-1]
        q_p, k_p, v_p, dout_p, out_p = (_pad8(t) for t in (q_bshd, k_bshd, v_bshd, dout_bshd, out_bshd))
        dq, dk, dv = torch.empty_like(q_p), torch.empty_like(k_p), torch.empty_like(v_p)
        self._fa._flash_attn_backward(dout_p, q_p, k_p, v_p, out_p, lse_bhs.float().contiguous(), dq, dk, dv,
                                      0.0, scale, causal, window[0], window[1],
                                      0.0 if softcap is None else float(softcap), None, False, None)
        return dq.narrow(-1, 0, d), dk.narrow(-1, 0, d), dv.narrow(-1, 0, dv_width)


def _window(sq: int, sk: int, lo, hi):
    """flash-attn's (left, right) for the band lo <= j - i <= hi of an sq x sk block (-1: unbounded),
    or None when one of them would be negative (no window states that band)."""
    left = -1 if lo is None else sk - sq - lo
    right = -1 if hi is None else hi - (sk - sq)
    if (lo is not None and left < 0) or (hi is not None and right < 0):
        return None
    return left, right


def _pad8(x_bshd):
    """The head dim zero-padded to a multiple of 8 (flash-attn's requirement); contiguous."""
    extra = -x_bshd.shape[-1] % 8
    return (torch.nn.functional.pad(x_bshd, (0, extra)) if extra else x_bshd).contiguous()
