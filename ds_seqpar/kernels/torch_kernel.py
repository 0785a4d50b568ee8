"""PyTorch's fused SDPA kernels, called at the op level because the public SDPA hides the lse.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``) returns the
log-sum-exp and handles GQA natively (k/v with fewer heads). CUDA:
``aten._scaled_dot_product_flash_attention`` (+ ``_backward``); that op wants equal head counts,
so K/V heads are repeated locally, after communication, and their gradients summed back.
The ops take [batch, heads, seq, dim]; a transpose of our bshd tensors is a free view.

Softcap: no fused PyTorch op caps scores, so softcapped blocks take the exact written-out path
(math_kernel.py), ``SOFTCAP_ROWS`` query rows at a time so the scores never exceed that many rows
(a causal square as causal tiles on the diagonal plus full rectangles before them, merged).
"""
import torch

from .bands import cut_band
from .base import AttentionKernel, check_block
from .math_kernel import MathKernel
from .merge import acc_dtype, empty_accumulators, merge_

SOFTCAP_ROWS = 256
CPU_KEY_TILE = 512      # the CPU flash kernel skips masked work only in whole tiles of this many keys (measured:
#                         causal_tile's note); cost/pairs.py prices a masked block's computed pairs by it

aten = torch.ops.aten


def _bhsd(x_bshd):
    return x_bshd.transpose(1, 2)


def _repeat_kv(x_bshd, group):
    return x_bshd if group == 1 else x_bshd.repeat_interleave(group, dim=2)


def _sum_kv(dx_bshd, group):
    if group == 1:
        return dx_bshd
    b, s, h, d = dx_bshd.shape
    return dx_bshd.reshape(b, s, h // group, group, d).sum(3)


class TorchKernel(AttentionKernel):
    name = "torch"

    def pieces(self, nq, nk, lo, hi, device):
        # bands.py's cut with this kernel's measured preferences (below); on CUDA none applies
        return cut_band(nq, nk, lo, hi, lambda size: self.causal_tile(size, device),
                        lambda width: self.band_column(width, device))

    def causal_tile(self, size, device):
        # The CPU flash kernel skips masked work only in whole key tiles (CPU_KEY_TILE = 512): a causal
        # square of <= 512 tokens costs what the full square costs (fwd+bwd per visible pair, 8 heads
        # x 64: 214 ns at 512, 149 at 1024, 113 at 4096; full blocks 100 at any size). Cut into 128-token tiles
        # (256 past 1024), a 512 square runs 1.5x faster, 1024 ~1.1x; larger ones gain little.
        if torch.device(device).type != "cpu" or size <= 256:
            return None
        return 128 if size <= 1024 else 256

    def band_column(self, width, device):
        # A window cut by rows costs two 128-token squares per 128 rows, each at twice its pairs' price;
        # cut by key columns of 128, the same edges are tall causal blocks at near full-block speed
        # (fwd+bwd per visible pair, 8 heads x 64: a 576 x 128 tall block 126 ns, a 128 square 224,
        # a full block 105-113). Narrow bands keep the row cut: their columns would be mostly triangle.
        if torch.device(device).type != "cpu" or width < 256:
            return None
        return 128

    def forward(self, q_bshd, k_bshd, v_bshd, causal, scale, softcap=None):
        # on CPU the op aligns causal top-left, so tall causal blocks (band_column's key columns) are exact too
        check_block(q_bshd, k_bshd, v_bshd, causal and (q_bshd.is_cuda or q_bshd.shape[1] <= k_bshd.shape[1]))
        if softcap is not None:
            return _softcap_forward(q_bshd, k_bshd, v_bshd, causal, scale, softcap)
        if q_bshd.is_cuda:
            return self._forward_cuda(q_bshd, k_bshd, v_bshd, causal, scale)
        out_bhsd, lse_bhs = aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q_bshd), _bhsd(k_bshd), _bhsd(v_bshd), 0.0, causal, scale=scale)
        return out_bhsd.transpose(1, 2), lse_bhs.to(acc_dtype(q_bshd.dtype))

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale, softcap=None):
        if softcap is not None:
            return _softcap_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale, softcap)
        if q_bshd.is_cuda:
            return self._backward_cuda(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout_bshd), _bhsd(q_bshd), _bhsd(k_bshd), _bhsd(v_bshd), _bhsd(out_bshd),
            lse_bhs, 0.0, causal, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    # CUDA: flash SDPA. Written against the aten op schema of torch 2.x.
    def _forward_cuda(self, q_bshd, k_bshd, v_bshd, causal, scale):
        group = q_bshd.shape[2] // k_bshd.shape[2]
        res = aten._scaled_dot_product_flash_attention(
            _bhsd(q_bshd), _bhsd(_repeat_kv(k_bshd, group)), _bhsd(_repeat_kv(v_bshd, group)),
            0.0, causal, False, scale=scale)
        out_bhsd, lse_bhs = res[0], res[1]
        return out_bhsd.transpose(1, 2), lse_bhs.to(acc_dtype(q_bshd.dtype))

    def _backward_cuda(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale):
        group = q_bshd.shape[2] // k_bshd.shape[2]
        sq, sk = q_bshd.shape[1], k_bshd.shape[1]
        empty = torch.empty(0, device=q_bshd.device, dtype=torch.int64)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout_bshd), _bhsd(q_bshd), _bhsd(_repeat_kv(k_bshd, group)),
            _bhsd(_repeat_kv(v_bshd, group)), _bhsd(out_bshd), lse_bhs, empty, empty, sq, sk,
            0.0, causal, empty, empty, scale=scale)
        return (dq.transpose(1, 2), _sum_kv(dk.transpose(1, 2), group), _sum_kv(dv.transpose(1, 2), group))


# -- softcap: the written-out path, a few query rows at a time ---------------------------------

_MATH = MathKernel()


def _row_pieces(sq, sk, causal):
    """(rows, keys, causal) pieces covering the block, SOFTCAP_ROWS query rows each; a causal block
    may be tall (sq > sk, top-left: rows from sk on see every key)."""
    cuts = sorted({*range(0, sq, SOFTCAP_ROWS), *([sk] if causal and sk < sq else []), sq})
    for a, b in zip(cuts, cuts[1:]):
        if not causal or a >= sk:
            yield slice(a, b), slice(0, sk), False
            continue
        yield slice(a, b), slice(a, b), True
        if a:
            yield slice(a, b), slice(0, a), False


def _softcap_forward(q_bshd, k_bshd, v_bshd, causal, scale, softcap):
    out_acc, lse_acc = empty_accumulators(q_bshd, v_bshd.shape[-1])
    for rows, keys, c in _row_pieces(q_bshd.shape[1], k_bshd.shape[1], causal):
        out, lse = _MATH.forward(q_bshd[:, rows], k_bshd[:, keys], v_bshd[:, keys], c, scale, softcap)
        merge_(out_acc[:, rows], lse_acc[:, :, rows], out, lse)
    return out_acc.to(q_bshd.dtype), lse_acc


def _softcap_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale, softcap):
    dtype = acc_dtype(q_bshd.dtype)
    dq = torch.zeros(q_bshd.shape, dtype=dtype, device=q_bshd.device)
    dk = torch.zeros(k_bshd.shape, dtype=dtype, device=k_bshd.device)
    dv = torch.zeros(v_bshd.shape, dtype=dtype, device=v_bshd.device)
    for rows, keys, c in _row_pieces(q_bshd.shape[1], k_bshd.shape[1], causal):
        g = _MATH.backward(dout_bshd[:, rows], q_bshd[:, rows], k_bshd[:, keys], v_bshd[:, keys],
                           out_bshd[:, rows], lse_bhs[:, :, rows], c, scale, softcap)
        dq[:, rows] += g[0]
        dk[:, keys] += g[1]
        dv[:, keys] += g[2]
    return dq.to(q_bshd.dtype), dk.to(k_bshd.dtype), dv.to(v_bshd.dtype)
