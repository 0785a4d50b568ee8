"""PyTorch's fused SDPA kernels, called at the op level because the public SDPA hides the lse.

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``) returns the
log-sum-exp and handles GQA natively (k/v with fewer heads). CUDA:
``aten._scaled_dot_product_flash_attention`` (+ ``_backward``); that op wants equal head counts,
so K/V heads are repeated locally, after communication, and their gradients summed back.
The ops take [batch, heads, seq, dim]; a transpose of our bshd tensors is a free view.
"""
import torch

from .base import AttentionKernel, check_block

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

    def causal_tile(self, size, device):
        # The CPU flash kernel skips masked work only in whole key tiles of 512: a causal square of
        # <= 512 tokens costs what the full square costs (fwd+bwd per visible pair, 8 heads x 64: 214 ns
        # at 512, 149 at 1024, 113 at 4096; full blocks 100 at any size). Cut into 128-token tiles
        # (256 past 1024), a 512 square runs 1.5x faster, 1024 ~1.1x; larger ones gain little.
        if torch.device(device).type != "cpu" or size <= 256:
            return None
        return 128 if size <= 1024 else 256

    def forward(self, q_bshd, k_bshd, v_bshd, causal, scale):
        check_block(q_bshd, k_bshd, v_bshd, causal)
        if q_bshd.is_cuda:
            return self._forward_cuda(q_bshd, k_bshd, v_bshd, causal, scale)
        out_bhsd, lse_bhs = aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q_bshd), _bhsd(k_bshd), _bhsd(v_bshd), 0.0, causal, scale=scale)
        return out_bhsd.transpose(1, 2), lse_bhs.float()

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale):
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
        return out_bhsd.transpose(1, 2), lse_bhs.float()

    def _backward_cuda(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale):
        group = q_bshd.shape[2] // k_bshd.shape[2]
        sq, sk = q_bshd.shape[1], k_bshd.shape[1]
        empty = torch.empty(0, device=q_bshd.device, dtype=torch.int64)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout_bshd), _bhsd(q_bshd), _bhsd(_repeat_kv(k_bshd, group)),
            _bhsd(_repeat_kv(v_bshd, group)), _bhsd(out_bshd), lse_bhs, empty, empty, sq, sk,
            0.0, causal, empty, empty, scale=scale)
        return (dq.transpose(1, 2), _sum_kv(dk.transpose(1, 2), group), _sum_kv(dv.transpose(1, 2), group))
