"""The band in the kernel contract (kernels/base.py: ``band`` / ``band_backward``): the default cut, the
torch kernel's own cut (CPU tiles and key columns of tall blocks) and flash-attn's single call with
window_size, each against the band written out with a mask, forward and backward."""
from __future__ import annotations

import types

import pytest
import torch

from ds_seqpar.kernels import MathKernel, TorchKernel
from ds_seqpar.kernels.bands import trimmed

from ..reference import assert_derived_close, band_visible
from .test_flash_attn_conformance import _flash_kernel, stand_in
from .test_kernels import _inputs, _masked_reference

# (rows, keys, lo, hi): causal, a window, a wide and a tall band, the far edge alone, every pair, and a
# window of >= 256 diagonals (the torch kernel's key columns) with its own causal tiles
BANDS = [(16, 16, None, 0), (16, 16, -5, 0), (12, 18, -3, 6), (20, 12, -10, None), (16, 16, 0, None),
         (10, 14, None, None), (300, 300, -259, 0)]



def _band_grads(kernel, q, k, v, dout, lo, hi, softcap):
    out, lse = kernel.band(q, k, v, lo, hi, 0.25, softcap)
    grads = kernel.band_backward(dout, q, k, v, out.to(q.dtype), lse, lo, hi, 0.25, softcap)
    return (out, *grads)


@pytest.mark.parametrize("kernel", [MathKernel(), TorchKernel()], ids=["default", "torch"])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("nq,nk,lo,hi", BANDS)
def test_band_is_the_masked_attention(kernel, softcap, nq, nk, lo, hi):
    band = trimmed(0, nq, 0, nk, lo, hi)
    assert band == (slice(0, nq), slice(0, nk), lo, hi), f"every row of the case sees a key: {band}"
    q, k, v, dout = _inputs(7, sq=nq, sk=nk)
    visible = band_visible(nq, nk, lo, hi)
    ref64 = _masked_reference(q, k, v, dout, visible, 0.25, torch.float64, softcap)
    plain = _masked_reference(q, k, v, dout, visible, 0.25, torch.float32, softcap)
    got = _band_grads(kernel, q, k, v, dout, lo, hi, softcap)
    for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
        assert_derived_close(f"{kernel.name} band ({lo}, {hi}) {nq}x{nk} softcap={softcap} {name}", g.to(p.dtype), r, p)


def test_torch_kernel_cuts_a_wide_window_into_key_columns():
    """Its own cut: tall causal blocks over 128-key columns (measured faster on CPU), the default none."""
    tall = [s for s in TorchKernel().pieces(600, 600, -299, 0, "cpu") if s.causal and s.q.stop - s.q.start > 128]
    assert len(tall) >= 3 and all(s.k.stop - s.k.start <= 128 for s in tall)
    assert not any(s.q.stop - s.q.start != s.k.stop - s.k.start
                   for s in MathKernel().pieces(600, 600, -299, 0, "cpu") if s.causal or s.anti)


def _counting_stand_in():
    calls = {"forward": 0, "backward": 0}

    def forward(*args, **kwargs):
        calls["forward"] += 1
        return stand_in._flash_attn_forward(*args, **kwargs)

    def backward(*args, **kwargs):
        calls["backward"] += 1
        return stand_in._flash_attn_backward(*args, **kwargs)
    module = types.ModuleType("flash_attn.flash_attn_interface")
    module._flash_attn_forward, module._flash_attn_backward = forward, backward
    return module, calls


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("nq,nk,lo,hi", BANDS[:-1] + [(40, 40, -17, 0)])
def test_flash_band_is_one_call_with_window_size(softcap, nq, nk, lo, hi):
    """flash-attn takes a band in ONE forward and ONE backward call (window_size = the band's offsets),
    exact against the masked reference (fp64 inputs, the stand-in's extension; its lse is fp32)."""
    module, calls = _counting_stand_in()
    q, k, v, dout = (t.double() for t in _inputs(8, sq=nq, sk=nk))
    got = _band_grads(_flash_kernel(module), q, k, v, dout, lo, hi, softcap)
    assert calls == {"forward": 1, "backward": 1}, calls
    want = _masked_reference(q, k, v, dout, band_visible(nq, nk, lo, hi), 0.25, torch.float64, softcap)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):     # (flash-attn's lse is fp32)
        torch.testing.assert_close(g, w, rtol=0.0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_flash_band_no_window_can_state_takes_the_default_cut():
    """An untrimmed wide band whose upper edge ends left of the block's last diagonal (hi < sk - sq): a
    negative right edge, which flash-attn would read as unbounded; the kernel cuts that band instead.
    (A trimmed band, as the plans give, always has both edges >= 0: one call.)"""
    module, calls = _counting_stand_in()
    q, k, v, dout = (t.double() for t in _inputs(9, sq=4, sk=12))
    got = _band_grads(_flash_kernel(module), q, k, v, dout, None, 2, None)
    want = _masked_reference(q, k, v, dout, band_visible(4, 12, None, 2), 0.25, torch.float64)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=0.0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert calls["forward"] >= 1 and calls["backward"] >= 1


@pytest.mark.parametrize("kernel", ["flash", "default"])
def test_band_into_the_callers_accumulators_equals_its_result(kernel):
    """As the ring loop calls it: the band folded into accumulators of more rows (merge.py views), over
    rows another block wrote first (merged) and keys another band wrote first (added)."""
    from ds_seqpar.kernels.merge import Merge, Sum
    kern = _flash_kernel() if kernel == "flash" else MathKernel()
    q, k, v, dout = (t.double() for t in _inputs(10, sq=24, sk=24))
    rows, keys, lo, hi = slice(4, 20), slice(2, 18), -5, 0
    want_out, want_lse = kern.band(q[:, rows], k[:, keys], v[:, keys], lo, hi, 0.25)
    acc = Merge.empty(q, v.shape[-1])
    assert kern.band(q[:, rows], k[:, keys], v[:, keys], lo, hi, 0.25, into=acc.part(rows)) is None
    torch.testing.assert_close(acc.out[:, rows].double(), want_out.double(), rtol=0.0, atol=1e-6)
    torch.testing.assert_close(acc.lse[:, :, rows], want_lse.to(acc.lse.dtype), rtol=0.0, atol=1e-6)
    assert torch.isneginf(acc.lse[:, :, :4]).all() and (acc.out[:, 20:] == 0).all()
    out, lse = want_out.to(q.dtype), want_lse
    want = kern.band_backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out, lse, lo, hi, 0.25)
    sums = [Sum.empty(t) for t in (q, k, v)]
    sums[1].add_(slice(0, 4), torch.ones_like(k[:, :4], dtype=torch.float32))      # keys 2, 3 written before
    kern.band_backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out, lse, lo, hi, 0.25,
                       into=(sums[0].part(rows), sums[1].part(keys), sums[2].part(keys)))
    dq, dk, dv = (s.total() for s in sums)
    torch.testing.assert_close(dq[:, rows].double(), want[0].double(), rtol=0.0, atol=1e-6)
    torch.testing.assert_close(dv[:, keys].double(), want[2].double(), rtol=0.0, atol=1e-6)
    torch.testing.assert_close(dk[:, 4:18].double(), want[1][:, 2:].double(), rtol=0.0, atol=1e-6)
    torch.testing.assert_close(dk[:, 2:4].double(), want[1][:, :2].double() + 1, rtol=0.0, atol=1e-6)
    assert (dq[:, :4] == 0).all() and (dk[:, 18:] == 0).all() and (dk[:, :2] == 1).all()
