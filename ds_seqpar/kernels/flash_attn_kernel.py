"""Dao-AILab flash-attn (CUDA only), through its lse-returning internal entry points.

flash-attn aligns a causal mask bottom-right when seq_q != seq_k; ds_seqpar only asks for causal
on square blocks, where both alignments agree (``check_block`` enforces it). GQA is native.
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

    def forward(self, q_bshd, k_bshd, v_bshd, causal, scale):
        check_block(q_bshd, k_bshd, v_bshd, causal)
        res = self._fa._flash_attn_forward(q_bshd, k_bshd, v_bshd, 0.0, scale, causal=causal,
                                           window_size_left=-1, window_size_right=-1, softcap=0.0,
                                           alibi_slopes=None, return_softmax=False)
        return res[0], res[1].float()

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale):
        dq, dk, dv = torch.empty_like(q_bshd), torch.empty_like(k_bshd), torch.empty_like(v_bshd)
        self._fa._flash_attn_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, dq, dk, dv,
                                      0.0, scale, causal, -1, -1, 0.0, None, False)
        return dq, dk, dv
