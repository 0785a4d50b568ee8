"""Single-process references and derived tolerances for the exactness tests.

Derived tolerance (docs/design.md, section 5): the fast path's error against a float64 reference may be at
most K times the error of a plain same-precision implementation against that reference, plus a
floor far below any real bug (a wrong mask or a lost block moves results by O(1e-2) or more).
"""

import torch

from ds_seqpar.kernels import MathKernel

K = 5.0


def attention_with_grads(q, k, v, dout, causal, scale, dtype):
    """(out, dq, dk, dv) of plain full-sequence attention computed in ``dtype``."""
    kern = MathKernel()
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = kern.forward(q, k, v, causal, scale)
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, causal, scale)
    return out, dq, dk, dv


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def assert_derived_close(name, got, ref64, plain, k=K, floor=1e-6):
    """``got`` vs the float64 ``ref64``, with the bound set by ``plain`` (same dtype as got)."""
    scale = ref64.abs().max().item() or 1.0
    bound = k * max_err(plain, ref64) + floor * scale
    err = max_err(got, ref64)
    assert err <= bound, (f"{name}: max error {err:.3e} vs float64 exceeds derived bound {bound:.3e} "
                          f"(plain {got.dtype} error {max_err(plain, ref64):.3e}, K={k})")


def packed_attention_with_grads(q, k, v, dout, bounds, causal, scale, dtype):
    """(out, dq, dk, dv) of attention computed per document separately (batch 1): document d is
    tokens [bounds[d], bounds[d+1]); tokens past bounds[-1] (end padding) get zeros."""
    parts = [attention_with_grads(q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], causal, scale, dtype)
             for a, b in zip(bounds, bounds[1:])]
    pad = q.shape[1] - bounds[-1]
    out = []
    for i, like in enumerate((q, q, k, v)):
        cat = [p[i] for p in parts]
        if pad:
            width = v.shape[-1] if i == 0 else like.shape[-1]
            cat.append(like.new_zeros(like.shape[0], pad, like.shape[2], width).to(cat[0].dtype))
        out.append(torch.cat(cat, dim=1))
    return tuple(out)
