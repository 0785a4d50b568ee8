"""Plain attention written out: the fp32/fp64 reference every fast path is checked against.

Scores are materialised ([batch, kv_heads, group, seq_q, seq_k]), so this is for tests and small
blocks (the torch kernel calls it a few query rows at a time for softcapped blocks). GQA without
repeating K/V: q heads are viewed as [kv_heads, group].

Softcap: capped = c * tanh(raw / c) with raw = scale * q.k; d capped / d raw = 1 - tanh^2.
"""
import torch

from .base import AttentionKernel, check_block


def _grouped(q_bshd, kv_heads):
    b, s, h, d = q_bshd.shape
    return q_bshd.reshape(b, s, kv_heads, h // kv_heads, d)   # [b, s, hkv, g, d]


def _causal_mask(sq, sk, device):
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


class MathKernel(AttentionKernel):
    name = "math"

    def _compute_dtype(self, x):
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def forward(self, q_bshd, k_bshd, v_bshd, causal, scale, softcap=None):
        check_block(q_bshd, k_bshd, v_bshd, causal)
        ct = self._compute_dtype(q_bshd)
        hkv = k_bshd.shape[2]
        qg = _grouped(q_bshd.to(ct), hkv)
        scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k_bshd.to(ct)) * scale   # [b, hkv, g, sq, sk]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if causal:
            scores = scores.masked_fill(~_causal_mask(q_bshd.shape[1], k_bshd.shape[1], q_bshd.device), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)                                      # [b, hkv, g, sq]
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        out = torch.einsum("bkgqs,bskd->bqkgd", probs, v_bshd.to(ct))
        b, sq, h, _ = q_bshd.shape
        out_bshd = out.reshape(b, sq, h, v_bshd.shape[-1]).to(q_bshd.dtype)
        lse_bhs = lse.reshape(b, h, sq).float() if ct == torch.float32 else lse.reshape(b, h, sq)
        return out_bshd, lse_bhs

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale, softcap=None):
        ct = self._compute_dtype(q_bshd)
        b, sq, h, d = q_bshd.shape
        hkv = k_bshd.shape[2]
        qg = _grouped(q_bshd.to(ct), hkv)
        k, v = k_bshd.to(ct), v_bshd.to(ct)
        scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k) * scale
        tanh = None
        if softcap is not None:
            tanh = torch.tanh(scores / softcap)
            scores = tanh * softcap
        if causal:
            scores = scores.masked_fill(~_causal_mask(sq, k.shape[1], q_bshd.device), float("-inf"))
        lse = lse_bhs.to(ct).reshape(b, hkv, h // hkv, sq)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)                  # [b, hkv, g, sq, sk]
        dout_g = _grouped(dout_bshd.to(ct), hkv)
        out_g = _grouped(out_bshd.to(ct), hkv)
        dv = torch.einsum("bkgqs,bqkgd->bskd", probs, dout_g)
        dprobs = torch.einsum("bqkgd,bskd->bkgqs", dout_g, v)
        delta = (dout_g * out_g).sum(-1).permute(0, 2, 3, 1)                           # [b, hkv, g, sq]
        dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
        if tanh is not None:
            dscores = dscores * (1 - tanh * tanh)
        dq = torch.einsum("bkgqs,bskd->bqkgd", dscores, k).reshape(b, sq, h, d)
        dk = torch.einsum("bkgqs,bqkgd->bskd", dscores, qg)
        return dq.to(q_bshd.dtype), dk.to(k_bshd.dtype), dv.to(v_bshd.dtype)
