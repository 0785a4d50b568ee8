"""Single-process references and derived tolerances for the exactness tests.

Derived tolerance (docs/design.md, section 5): the fast path's error against a float64 reference may be at
most K times the error of a plain same-precision implementation against that reference, plus a
floor far below any real bug (a wrong mask or a lost block moves results by O(1e-2) or more).
"""

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
