"""Local kernels and the lse merge, single process."""
import pytest
import torch

from ds_seqpar.kernels import MathKernel, TorchKernel, empty_accumulators, get_kernel, merge_
from ds_seqpar.config import ConfigError

from ..reference import assert_derived_close, attention_with_grads


def _inputs(seed, sq=48, sk=48, h=4, hkv=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq, h, d, generator=g, dtype=dtype)
    k = torch.randn(2, sk, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(2, sk, hkv, d, generator=g, dtype=dtype)
    dout = torch.randn(2, sq, h, d, generator=g, dtype=dtype)
    return q, k, v, dout


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_torch_kernel_matches_reference(causal, hkv):
    q, k, v, dout = _inputs(0, hkv=hkv)
    scale = 0.25
    ref64 = attention_with_grads(q, k, v, dout, causal, scale, torch.float64)
    plain = attention_with_grads(q, k, v, dout, causal, scale, torch.float32)
    kern = TorchKernel()
    out, lse = kern.forward(q, k, v, causal, scale)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 48)
    grads = kern.backward(dout, q, k, v, out, lse, causal, scale)
    for name, got, r, p in zip(("out", "dq", "dk", "dv"), (out, *grads), ref64, plain):
        assert got.shape == r.shape, name
        assert_derived_close(name, got, r, p)


def test_math_lse_is_logsumexp_of_scores():
    q, k, v, _ = _inputs(1, hkv=4, dtype=torch.float64)
    _, lse = MathKernel().forward(q, k, v, False, 0.25)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_merge_of_two_key_blocks_equals_whole():
    """Attention over keys [0, 24) and [24, 48) merged == attention over [0, 48)."""
    q, k, v, _ = _inputs(2, hkv=2)
    kern = TorchKernel()
    whole, lse_whole = kern.forward(q, k, v, False, 0.25)
    out_acc, lse_acc = empty_accumulators(q, v.shape[-1])
    for sl in (slice(0, 24), slice(24, 48)):
        o, l = kern.forward(q, k[:, sl], v[:, sl], False, 0.25)
        merge_(out_acc, lse_acc, o, l)
    torch.testing.assert_close(out_acc, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_acc, lse_whole, rtol=1e-5, atol=1e-6)


def test_merge_keeps_rows_that_saw_nothing_finite():
    q, k, v, _ = _inputs(3, sq=8, sk=8, hkv=2)
    out_acc, lse_acc = empty_accumulators(q, v.shape[-1])
    empty_out = torch.zeros_like(out_acc)
    empty_lse = torch.full_like(lse_acc, float("-inf"))
    merge_(out_acc, lse_acc, empty_out, empty_lse)
    assert torch.isfinite(out_acc).all() and torch.isneginf(lse_acc).all()
    o, l = TorchKernel().forward(q, k, v, False, 0.25)
    merge_(out_acc, lse_acc, o, l)
    torch.testing.assert_close(out_acc, o)


def test_merge_with_huge_logits_has_no_overflow():
    q, k, v, _ = _inputs(4, sq=8, sk=16, hkv=2)
    q = q * 1e3
    kern = MathKernel()
    whole, _ = kern.forward(q, k, v, False, 1.0)
    out_acc, lse_acc = empty_accumulators(q, v.shape[-1])
    for sl in (slice(0, 8), slice(8, 16)):
        merge_(out_acc, lse_acc, *kern.forward(q, k[:, sl], v[:, sl], False, 1.0))
    assert torch.isfinite(out_acc).all()
    torch.testing.assert_close(out_acc, whole, rtol=1e-4, atol=1e-4)


def test_causal_needs_square_block():
    q, k, v, _ = _inputs(5, sq=8, sk=16)
    with pytest.raises(ValueError, match="causal block must be square"):
        TorchKernel().forward(q, k, v, True, 0.25)


def test_backend_resolution():
    assert get_kernel("auto", "cpu").name == "torch"
    assert get_kernel("math", "cpu").name == "math"
    with pytest.raises(ConfigError, match="backend='flash_attn' needs CUDA and the flash-attn package"):
        get_kernel("flash_attn", "cpu")


def _masked_reference(q, k, v, dout, visible, scale, dtype, softcap=None):
    """(out, dq, dk, dv) written out in ``dtype`` with a [sq, sk] visibility mask (GQA by repeat)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(group, 2))
    out.backward(dout.to(dtype))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("anti", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_tall_causal_and_anti_blocks_match_reference(monkeypatch, anti, softcap):
    """The CPU kernel's tall blocks (a window cut into key columns, kernels/bands.py): top-left
    causal (rows past seq_k see every key) and its bottom-right mirror, softcapped too (the written-out
    path, cut at the triangle's end: SOFTCAP_ROWS made small so the cut lands inside the block)."""
    import ds_seqpar.kernels.torch_kernel as tk
    monkeypatch.setattr(tk, "SOFTCAP_ROWS", 16)
    q, k, v, dout = _inputs(3, sq=40, sk=12)
    i, j = torch.arange(40)[:, None], torch.arange(12)[None, :]
    visible = j >= i - 28 if anti else j <= i
    kern, scale = TorchKernel(), 0.25
    assert kern.band_column(1024, "cpu") == 128 and kern.band_column(1024, "cuda") is None
    out, lse = kern.forward_block(q, k, v, not anti, anti, scale, softcap)
    grads = kern.backward_block(dout, q, k, v, out, lse, not anti, anti, scale, softcap)
    ref64 = _masked_reference(q, k, v, dout, visible, scale, torch.float64, softcap)
    plain = _masked_reference(q, k, v, dout, visible, scale, torch.float32, softcap)
    for name, got, r, p in zip(("out", "dq", "dk", "dv"), (out, *grads), ref64, plain):
        assert_derived_close(f"anti={anti} softcap={softcap} {name}", got, r, p)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_torch_kernel_runs_float64_forward_and_backward(softcap):
    """float64 blocks keep float64 out, lse and gradients (the lse was fp32 and the CPU op's backward
    refused it), equal to the float64 math kernel to float64 rounding."""
    q, k, v, dout = (t.double() for t in _inputs(5))
    got_out, got_lse = TorchKernel().forward(q, k, v, True, 0.25, softcap)
    ref_out, ref_lse = MathKernel().forward(q, k, v, True, 0.25, softcap)
    assert got_out.dtype == got_lse.dtype == torch.float64
    got = TorchKernel().backward(dout, q, k, v, got_out, got_lse, True, 0.25, softcap)
    ref = MathKernel().backward(dout, q, k, v, ref_out, ref_lse, True, 0.25, softcap)
    for g, r in zip((got_out, got_lse, *got), (ref_out, ref_lse, *ref)):
        assert g.dtype == torch.float64
        assert (g - r).abs().max().item() <= 1e-12 * r.abs().max().item()
