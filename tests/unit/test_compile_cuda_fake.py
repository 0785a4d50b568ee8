"""The CUDA branches under torch.compile, traced on CPU with fake CUDA tensors (FakeTensorMode): no GPU here.

1. The CUDA kernels the op's body calls on each block: torch's flash SDPA aten ops (their schemas and
   meta shapes) and flash-attn's entry points (the strict stand-in of test_flash_attn_conformance,
   written to flash-attn's signatures) with causal, full, anti-causal and window-band blocks, softcap,
   bf16: each (out, lse) has the shape, dtype and device the op's fake promises the compiler
   (``fake_ring``), and the gradients q's, k's and v's. (The ring loop around them is the same code on
   every device; Python indexing of a fake CUDA tensor needs a CUDA build, so it runs on CPU tensors in
   the dist tests.)
2. The ops as the compiler sees them on CUDA inputs: ds_seqpar::attention and its backward in fake
   mode (their registered fakes) keep the device and dtypes.
"""
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ds_seqpar.comm import CommStats
from ds_seqpar.kernels import TorchKernel
from ds_seqpar.masks import Mask
from ds_seqpar.ops import handle
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies import StrategyContext
from ds_seqpar.strategies.ring import RingAttention
from ds_seqpar.strategies.ring_loop import fake_ring

from . import test_flash_attn_conformance as conformance


def _shapes_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                    alibi_slopes, return_softmax):
    """flash-attn's forward as the compiler would see it: the conformance stand-in's argument checks
    (names and positions, types, dtypes, head_dim, GQA), then outputs of the documented shapes."""
    b, sq, _, h, _, _ = conformance._check_qkv(q, k, v)
    conformance._check_scalars(dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                               alibi_slopes)
    return (torch.empty_like(q), torch.empty(b, h, sq, dtype=torch.float32, device=q.device), None,
            torch.empty(2, dtype=torch.int64, device=q.device))


def _shapes_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, *args, **kwargs):
    """flash-attn's backward: the stand-in's checks of every argument on shapes alone (softmax_lse a
    contiguous fp32 [b, h, sq]), dq, dk, dv written in place."""
    b, sq, _, h, _, _ = conformance._check_qkv(q, k, v)
    conformance._require(softmax_lse.dtype == torch.float32 and softmax_lse.is_contiguous()
                         and tuple(softmax_lse.shape) == (b, h, sq), "softmax_lse: contiguous fp32 [b, h, sq]")
    for name, t, like in (("dout", dout, q), ("out", out, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        conformance._require(t.shape == like.shape and t.dtype == like.dtype and t.stride(-1) == 1, name)
    return torch.empty(b, h, sq, dtype=torch.float32, device=q.device)


_SHAPES = types.ModuleType("flash_attn.flash_attn_interface")
_SHAPES._flash_attn_forward, _SHAPES._flash_attn_backward = _shapes_forward, _shapes_backward


N, HEADS, KV_HEADS, D = 128, 4, 2, 64
KERNELS = {"torch": TorchKernel, "flash_attn": lambda: conformance._flash_kernel(_SHAPES)}


def _ctx(kernel):
    """One ring position: the ring loop's single step, nothing travels (no process group needed)."""
    return StrategyContext(sp_group=None, ulysses_group=None, ring_group=None, sp_size=1, sp_rank=0, ulysses_size=1,
                           ulysses_rank=0, ring_size=1, ring_rank=0, kernel=kernel, stats=CommStats(),
                           layout=make_layout("contiguous", 1))


def _cuda(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _meta(t):
    return tuple(t.shape), t.dtype, t.device.type


# (kernel, call, softcap): each CUDA entry the ring loop makes on a block; band(lo, hi) = a window's band
# the torch kernel cuts bands into the blocks above, and its softcap is the written-out path (Python
# indexing: CPU tensors only here, the dist tests run it)
CALLS = [(k, c, cap) for k in KERNELS for c in ("causal", "full", "anti", "band") for cap in (None, 30.0)
         if k == "flash_attn" or (c != "band" and cap is None)]


@pytest.mark.parametrize("kernel,call,softcap", CALLS)
def test_cuda_kernels_give_what_the_fake_promises(kernel, call, softcap):
    kern = KERNELS[kernel]()
    with FakeTensorMode():
        q, dout = _cuda(1, N, HEADS, D), _cuda(1, N, HEADS, D)
        k, v = _cuda(1, N, KV_HEADS, D), _cuda(1, N, KV_HEADS, D)
        if call == "band":
            out, lse = kern.band(q, k, v, -15, 0, D ** -0.5, softcap)
            grads = kern.band_backward(dout, q, k, v, out, lse, -15, 0, D ** -0.5, softcap)
        else:
            causal, anti = call == "causal", call == "anti"
            out, lse = kern.forward_block(q, k, v, causal, anti, D ** -0.5, softcap)
            grads = kern.backward_block(dout, q, k, v, out, lse, causal, anti, D ** -0.5, softcap)
        fake_out, (fake_lse,) = fake_ring(q, v)
        assert (_meta(out), _meta(lse)) == (_meta(fake_out), _meta(fake_lse)), (kernel, call)
        assert [_meta(g) for g in grads] == [_meta(t) for t in (q, k, v)], (kernel, call)


class _Masks:
    """The mask seam's call the op's body makes (sp.masks.mask, sharding/batch_masks.py)."""

    def mask(self, q, causal, seq_len, cu_seqlens, window, blocks=None):
        return Mask(causal, window)


class _Owner:
    """What the op's body and fake look up by handle: a strategy and the mask seam."""

    def __init__(self, kernel):
        self.strategy = RingAttention(_ctx(kernel))
        self.masks = _Masks()


def test_the_ops_fakes_keep_cuda_bf16():
    """What the compiler plans with on a GPU: the forward op's out and saved, the backward op's gradients."""
    owner = _Owner(TorchKernel())
    options = (None, None, handle(owner), True, D ** -0.5, None, 16, 30.0, None)      # ..., softcap, blocks
    with FakeTensorMode():
        q, k, v = _cuda(1, N, HEADS, D), _cuda(1, N, KV_HEADS, D), _cuda(1, N, KV_HEADS, D)
        sinks = _cuda(HEADS, dtype=torch.float32)
        out, *saved = torch.ops.ds_seqpar.attention(q, k, v, sinks, *options)
        grads = torch.ops.ds_seqpar.attention_backward(torch.empty_like(out), q, k, v, sinks, out, saved, *options)
    assert _meta(out) == _meta(q) and [_meta(t) for t in saved] == [((1, HEADS, N), torch.float32, "cuda")]
    assert [_meta(g) for g in grads] == [_meta(t) for t in (q, k, v, sinks)]
