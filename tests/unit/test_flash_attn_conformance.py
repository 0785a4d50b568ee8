"""FlashAttnKernel's calls into flash-attn, checked on CPU against a strict stand-in.

No GPU is lent to this project and flash-attn (CUDA only) cannot be installed here, so the
``flash_attn.flash_attn_interface`` module is replaced by ``stand_in``, written in plain torch from
flash-attn's own definitions (flash_attn/flash_attn_interface.py and csrc/flash_attn/flash_api.cpp,
2.7.0 and later: the release that split ``window_size`` into ``window_size_left`` /
``window_size_right`` and cut ``_flash_attn_forward``'s return to 4 values):

    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                        softcap, alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                         rng_state=None) -> softmax_d         (dq, dk, dv written in place)

Semantics modelled: bshd tensors; GQA native (q head h reads k/v head h // (heads // kv_heads); dk/dv
summed over each group); query i sees key j iff  i + sk - sq - left <= j <= i + sk - sq + right
(-1: unbounded; a size >= seq_k is unbounded; causal forces right = 0, so causal is bottom-right
aligned); softcap 0.0 = off, else scores = softcap * tanh(scale * q.k / softcap); softmax_lse
[b, h, sq] fp32 of the (capped) scores, +inf for a row that sees no key; backward uses the *given*
out and softmax_lse (ds_seqpar passes a whole ring row's), not ones it recomputes.

Strictness: every argument the real call checks, or silently relies on, is asserted: parameter names
and positions (plain Python signatures identical to flash-attn's), int window sizes, float
dropout_p / softmax_scale / softcap, bool flags, last-dim-contiguous inputs, head_dim a multiple of
8 and <= 256, dq/dk/dv preallocated with q's dtype and the shapes of q/k/v (flash-attn writes its
results into them and returns only softmax_d, so a None there loses the gradients), rng_state None
or int64[2]. softmax_lse is read, as the CUDA kernel reads it, through a raw pointer as a contiguous
fp32 [b, h, sq] array: the stand-in does the same (``as_strided``), so a strided lse gives the wrong
rows here exactly as on a GPU, and a non-fp32 lse is refused (the GPU would misread its bytes).
Two documented deviations: the stand-in also accepts float64 inputs (flash-attn takes fp16/bf16
only) so that results can be compared to 1e-10, and it implements neither dropout nor ALiBi.
"""
import inspect
import types

import pytest
import torch

from ds_seqpar.kernels import MathKernel
from ds_seqpar.kernels.flash_attn_kernel import FlashAttnKernel


# ---------------------------------------------------------------------------------------------
# the stand-in


class FlashAttnContractError(RuntimeError):
    """A call the real flash-attn would refuse (TORCH_CHECK raises RuntimeError), or would misread."""


def _require(cond, msg):
    if not cond:
        raise FlashAttnContractError(msg)


_DTYPES = (torch.float16, torch.bfloat16, torch.float64)   # float64: the stand-in's one extension


def _is_float(x):
    return isinstance(x, float)


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _check_scalars(dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes):
    _require(_is_float(dropout_p), f"dropout_p must be a float, got {dropout_p!r}")
    _require(dropout_p == 0.0, "the stand-in implements no dropout")
    _require(_is_float(softmax_scale), f"softmax_scale must be a float, got {softmax_scale!r}")
    _require(isinstance(causal, bool), f"causal must be a bool, got {causal!r}")
    for name, w in (("window_size_left", window_size_left), ("window_size_right", window_size_right)):
        _require(_is_int(w), f"{name} must be an int (flash-attn's SymInt), got {w!r}")
        _require(w >= -1, f"{name} must be >= -1, got {w}")
    _require(_is_float(softcap), f"softcap must be a float (0.0 = off), got {softcap!r}")
    _require(softcap >= 0.0, f"softcap must be >= 0, got {softcap}")
    _require(alibi_slopes is None, "the stand-in implements no ALiBi")


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(isinstance(t, torch.Tensor) and t.dim() == 4, f"{name} must be a 4-D bshd tensor")
        _require(t.stride(-1) == 1, f"{name} must have contiguous last dimension")
    _require(q.dtype in _DTYPES, f"FlashAttention only supports fp16 and bf16 data type, got {q.dtype}")
    _require(k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype")
    b, sq, h, d = q.shape
    _, sk, hkv, _ = k.shape
    _require(b > 0, "batch size must be positive")
    _require(d % 8 == 0, f"head_size must be a multiple of 8, got {d}")
    _require(d <= 256, f"head dimension at most 256, got {d}")
    _require(hkv > 0 and h % hkv == 0, "Number of heads in key/value must divide number of heads in query")
    _require(tuple(k.shape) == (b, sk, hkv, d), f"k shape {tuple(k.shape)}")
    _require(tuple(v.shape) == (b, sk, hkv, d), f"v must be {(b, sk, hkv, d)}, got {tuple(v.shape)}")
    return b, sq, sk, h, hkv, d


def _visible(sq, sk, causal, left, right):
    """[sq, sk] bool: which keys each query sees, as flash_api.cpp normalises the window."""
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    if causal and sq == 1:            # mha_fwd: "causal=true is the same as causal=false in this case"
        causal = False
    if causal:
        right = 0
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    diag = i + sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def _compute_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _expand_heads(x_bshd, h):
    """k/v head of every q head: q head n reads kv head n // (h // hkv)."""
    return x_bshd.repeat_interleave(h // x_bshd.shape[2], dim=2)


def _scores(q, k, softmax_scale, softcap, causal, left, right):
    """(capped scores [b, h, sq, sk] with -inf where masked, tanh or None, visibility)."""
    ct = _compute_dtype(q)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    raw = torch.einsum("bqhd,bkhd->bhqk", q.to(ct), _expand_heads(k.to(ct), h)) * softmax_scale
    tanh = None
    if softcap > 0.0:
        tanh = torch.tanh(raw / softcap)
        raw = softcap * tanh
    ok = _visible(sq, sk, causal, left, right)
    return raw.masked_fill(~ok, float("-inf")), tanh, ok


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                        softcap, alibi_slopes, return_softmax):
    b, sq, sk, h, hkv, d = _check_qkv(q, k, v)
    _check_scalars(dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes)
    _require(isinstance(return_softmax, bool), f"return_softmax must be a bool, got {return_softmax!r}")
    _require(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    ct = _compute_dtype(q)
    s, _, ok = _scores(q, k, softmax_scale, softcap, causal, window_size_left, window_size_right)
    empty_row = ~ok.any(-1)                                                       # [sq]
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty_row, float("inf"))         # [b, h, sq]
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_heads(v.to(ct), h))
    S_dmask = torch.empty((0,), dtype=q.dtype)
    rng_state = torch.zeros((2,), dtype=torch.int64)
    return out.to(q.dtype), lse.float().contiguous(), S_dmask, rng_state


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                         rng_state=None):
    b, sq, sk, h, hkv, d = _check_qkv(q, k, v)
    _check_scalars(dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes)
    _require(isinstance(deterministic, bool), f"deterministic must be a bool, got {deterministic!r}")
    _require(rng_state is None or (isinstance(rng_state, torch.Tensor) and rng_state.dtype == torch.int64
                                   and tuple(rng_state.shape) == (2,)), f"rng_state must be None or int64[2]")
    for name, t, shape in (("dout", dout, (b, sq, h, d)), ("out", out, (b, sq, h, d))):
        _require(isinstance(t, torch.Tensor), f"{name} must be a tensor")
        _require(t.dtype == q.dtype, f"query and {name} must have the same dtype")
        _require(t.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
        _require(tuple(t.shape) == shape, f"{name} must be {shape}, got {tuple(t.shape)}")
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _require(isinstance(t, torch.Tensor), f"{name} must be a preallocated tensor (flash-attn writes into it), "
                                              f"got {t!r}")
        _require(t.dtype == q.dtype, f"{name} must have the same dtype as q")
        _require(t.stride(-1) == 1, f"{name} must have contiguous last dimension")
        _require(tuple(t.shape) == tuple(like.shape), f"{name} must be {tuple(like.shape)}, got {tuple(t.shape)}")
    _require(isinstance(softmax_lse, torch.Tensor) and softmax_lse.dtype == torch.float32,
             f"softmax_lse is read as fp32, got {getattr(softmax_lse, 'dtype', softmax_lse)!r}")
    # the CUDA kernel indexes softmax_lse_ptr as a dense [b, h, sq] array, whatever its strides
    lse = softmax_lse.as_strided((b, h, sq), (h * sq, sq, 1))

    ct = _compute_dtype(q)
    s, tanh, _ = _scores(q, k, softmax_scale, softcap, causal, window_size_left, window_size_right)
    p = torch.exp(s - lse.to(ct).unsqueeze(-1))                                    # [b, h, sq, sk]
    do, o = dout.to(ct), out.to(ct)
    k_h, v_h = _expand_heads(k.to(ct), h), _expand_heads(v.to(ct), h)
    dv_h = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v_h)
    softmax_d = (do * o).sum(-1).transpose(1, 2)                                  # [b, h, sq]
    ds = p * (dp - softmax_d.unsqueeze(-1))
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    ds = ds * softmax_scale
    dq_ = torch.einsum("bhqk,bkhd->bqhd", ds, k_h)
    dk_h = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(ct))
    g = h // hkv
    dq.copy_(dq_)
    dk.copy_(dk_h.reshape(b, sk, hkv, g, d).sum(3))
    dv.copy_(dv_h.reshape(b, sk, hkv, g, d).sum(3))
    sq_rounded = (sq + 127) // 128 * 128
    out_d = torch.zeros(b, h, sq_rounded, dtype=torch.float32)
    out_d[:, :, :sq] = softmax_d.float()
    return out_d


stand_in = types.ModuleType("flash_attn.flash_attn_interface")
stand_in._flash_attn_forward = _flash_attn_forward
stand_in._flash_attn_backward = _flash_attn_backward


def _flash_kernel(module=stand_in):
    kernel = FlashAttnKernel.__new__(FlashAttnKernel)    # skip __init__'s `import flash_attn`
    kernel._fa = module
    return kernel


# ---------------------------------------------------------------------------------------------
# inputs

B, H, D = 2, 4, 16
SCALE = 0.3
SOFTCAP = 2.0       # small enough that tanh bends most scores


def _inputs(seed, sq, sk, hkv, d=D, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, sq, H, d, generator=g, dtype=dtype) * 2
    k = torch.randn(B, sk, hkv, d, generator=g, dtype=dtype) * 2
    v = torch.randn(B, sk, hkv, d, generator=g, dtype=dtype)
    dout = torch.randn(B, sq, H, d, generator=g, dtype=dtype)
    return q, k, v, dout


BLOCKS = {                      # (causal, anti, seq_q, seq_k)
    "full": (False, False, 12, 20),
    "full_square": (False, False, 16, 16),
    "causal": (True, False, 16, 16),
    "anti": (False, True, 16, 16),
}

TIGHT = dict(rtol=0.0, atol=1e-10)
LSE_FP32 = dict(rtol=2.5e-7, atol=1e-12)    # flash-attn's lse is fp32: one rounding of the fp64 value


def _close(name, got, want, **tol):
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}", **tol)


# ---------------------------------------------------------------------------------------------
# the stand-in itself: documented signatures and window semantics


def test_stand_in_signatures_are_flash_attns():
    fwd = list(inspect.signature(stand_in._flash_attn_forward).parameters)
    bwd = inspect.signature(stand_in._flash_attn_backward).parameters
    assert fwd == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                   "softcap", "alibi_slopes", "return_softmax"]
    assert list(bwd) == ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p",
                         "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
                         "alibi_slopes", "deterministic", "rng_state"]
    assert bwd["rng_state"].default is None
    assert all(p.default is inspect.Parameter.empty for n, p in bwd.items() if n != "rng_state")


@pytest.mark.parametrize("sq,sk,causal,left,right", [
    (5, 5, True, -1, -1), (3, 7, True, -1, -1), (6, 4, True, -1, -1), (5, 5, False, 0, -1),
    (4, 7, False, 1, 2), (7, 4, False, -1, 0), (5, 5, False, 9, 9), (1, 6, True, -1, -1), (4, 6, True, 2, -1),
])
def test_stand_in_window_is_flash_attns(sq, sk, causal, left, right):
    """Brute force, one (query, key) pair at a time, of flash-attn's documented mask: bottom-right
    causal when seq_q != seq_k, window [i + sk - sq - left, i + sk - sq + right]; a row that sees no
    key has out 0 and lse +inf."""
    q, k, v, _ = _inputs(7, sq, sk, 2)
    out, lse, s_dmask, rng = stand_in._flash_attn_forward(q, k, v, 0.0, SCALE, causal, left, right, 0.0, None,
                                                          False)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, sq) and lse.is_contiguous()
    assert s_dmask.numel() == 0 and rng.dtype == torch.int64
    want_out, want_lse = torch.zeros_like(out), torch.empty(B, H, sq, dtype=torch.float64)
    for i in range(sq):
        lo = -10**9 if left < 0 else i + sk - sq - left
        hi = i + sk - sq + (0 if causal and sq > 1 else (10**9 if right < 0 else right))
        keys = [j for j in range(sk) if lo <= j <= hi]
        if not keys:
            want_lse[:, :, i] = float("inf")
            continue
        kk = k[:, keys].repeat_interleave(2, dim=2)               # H // hkv = 2
        vv = v[:, keys].repeat_interleave(2, dim=2)
        sc = torch.einsum("bhd,bkhd->bhk", q[:, i], kk) * SCALE
        want_lse[:, :, i] = torch.logsumexp(sc, -1)
        want_out[:, i] = torch.einsum("bhk,bkhd->bhd", torch.softmax(sc, -1), vv)
    _close("out", out, want_out, **TIGHT)
    _close("lse", lse, want_lse.float(), **LSE_FP32)


# ---------------------------------------------------------------------------------------------
# FlashAttnKernel against MathKernel


@pytest.mark.parametrize("hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["nocap", "softcap"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_forward_block_matches_math(block, softcap, hkv):
    causal, anti, sq, sk = BLOCKS[block]
    q, k, v, _ = _inputs(0, sq, sk, hkv)
    out, lse = _flash_kernel().forward_block(q, k, v, causal, anti, SCALE, softcap)
    ref_out, ref_lse = MathKernel().forward_block(q, k, v, causal, anti, SCALE, softcap)
    _close("out", out, ref_out, **TIGHT)
    _close("lse", lse, ref_lse.float(), **LSE_FP32)


@pytest.mark.parametrize("hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["nocap", "softcap"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_backward_block_matches_math(block, softcap, hkv):
    """Both kernels get the same out and fp32 lse (ds_seqpar's accumulators are fp32)."""
    causal, anti, sq, sk = BLOCKS[block]
    q, k, v, dout = _inputs(1, sq, sk, hkv)
    out, lse = MathKernel().forward_block(q, k, v, causal, anti, SCALE, softcap)
    lse = lse.float()
    got = _flash_kernel().backward_block(dout, q, k, v, out, lse, causal, anti, SCALE, softcap)
    want = MathKernel().backward_block(dout, q, k, v, out, lse, causal, anti, SCALE, softcap)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(name, g, w, **TIGHT)


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["nocap", "softcap"])
def test_block_grads_with_the_whole_rows_lse_sum_to_the_whole(softcap):
    """As ring_loop uses it: a row's keys in two blocks, each block's backward given the whole row's
    out and lse; the pieces are the whole attention's gradients."""
    q, k, v, dout = _inputs(2, 16, 24, 2)
    kern = _flash_kernel()
    out, lse = kern.forward_block(q, k, v, False, False, SCALE, softcap)
    dq, dk, dv = MathKernel().backward_block(dout, q, k, v, out, lse, False, False, SCALE, softcap)
    dq_sum = torch.zeros_like(dq)
    for sl in (slice(0, 10), slice(10, 24)):
        dq_blk, dk_blk, dv_blk = kern.backward_block(dout, q, k[:, sl], v[:, sl], out, lse, False, False, SCALE,
                                                     softcap)
        dq_sum += dq_blk
        _close("dk", dk_blk, dk[:, sl], **TIGHT)
        _close("dv", dv_blk, dv[:, sl], **TIGHT)
    _close("dq", dq_sum, dq, **TIGHT)


# ---------------------------------------------------------------------------------------------
# the checks can fail


def _bad_forward_calls(q, k, v):
    fa = stand_in._flash_attn_forward
    return {
        "flash-attn<2.7 window_size tuple": lambda: fa(q, k, v, 0.0, SCALE, causal=False, window_size=(-1, -1),
                                                      softcap=0.0, alibi_slopes=None, return_softmax=False),
        "float window": lambda: fa(q, k, v, 0.0, SCALE, False, -1.0, -1, 0.0, None, False),
        "bool window": lambda: fa(q, k, v, 0.0, SCALE, False, True, -1, 0.0, None, False),
        "softcap None": lambda: fa(q, k, v, 0.0, SCALE, False, -1, -1, None, None, False),
        "int dropout_p": lambda: fa(q, k, v, 0, SCALE, False, -1, -1, 0.0, None, False),
        "scale and causal swapped": lambda: fa(q, k, v, 0.0, False, SCALE, -1, -1, 0.0, None, False),
        "missing return_softmax": lambda: fa(q, k, v, 0.0, SCALE, False, -1, -1, 0.0, None),
        "fp32 inputs": lambda: fa(q.float(), k.float(), v.float(), 0.0, SCALE, False, -1, -1, 0.0, None, False),
        "head_dim 12": lambda: fa(q[..., :12], k[..., :12], v[..., :12], 0.0, SCALE, False, -1, -1, 0.0, None,
                                  False),
    }


BAD_FORWARD = ["flash-attn<2.7 window_size tuple", "float window", "bool window", "softcap None", "int dropout_p",
               "scale and causal swapped", "missing return_softmax", "fp32 inputs", "head_dim 12"]
BAD_BACKWARD = ["dq None (gradients lost)", "dk shaped like q's heads", "dv fp32", "lse fp64", "window tuple",
                "deterministic None", "rng_state list", "out fp32", "no deterministic"]


@pytest.mark.parametrize("case", BAD_FORWARD)
def test_stand_in_refuses_bad_forward_calls(case):
    q, k, v, _ = _inputs(3, 8, 8, 2)
    calls = _bad_forward_calls(q, k, v)
    assert list(calls) == BAD_FORWARD
    with pytest.raises((FlashAttnContractError, TypeError)):
        calls[case]()


def _bad_backward_calls(q, k, v, dout, out, lse):
    fa = stand_in._flash_attn_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def call(**over):
        args = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, dropout_p=0.0,
                    softmax_scale=SCALE, causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                    alibi_slopes=None, deterministic=False, rng_state=None)
        args.update(over)
        return lambda: fa(**args)

    return {
        "dq None (gradients lost)": call(dq=None),
        "dk shaped like q's heads": call(dk=torch.empty(q.shape[0], k.shape[1], q.shape[2], q.shape[3],
                                                        dtype=q.dtype)),
        "dv fp32": call(dv=torch.empty_like(v, dtype=torch.float32)),
        "lse fp64": call(softmax_lse=lse.double()),
        "window tuple": call(window_size_left=(-1, -1)),
        "deterministic None": call(deterministic=None),
        "rng_state list": call(rng_state=[0, 0]),
        "out fp32": call(out=out.float()),
        "no deterministic": lambda: fa(dout, q, k, v, out, lse, dq, dk, dv, 0.0, SCALE, False, -1, -1, 0.0, None),
    }


@pytest.mark.parametrize("case", BAD_BACKWARD)
def test_stand_in_refuses_bad_backward_calls(case):
    q, k, v, dout = _inputs(4, 8, 8, 2)
    out, lse, _, _ = stand_in._flash_attn_forward(q, k, v, 0.0, SCALE, False, -1, -1, 0.0, None, False)
    calls = _bad_backward_calls(q, k, v, dout, out, lse)
    assert list(calls) == BAD_BACKWARD
    with pytest.raises((FlashAttnContractError, TypeError)):
        calls[case]()


class _MirroredWindowKernel(FlashAttnKernel):
    """A wrong anti-causal window, (-1, 0): query i sees keys j <= i, i.e. causal, not anti."""

    def forward_block(self, q_bshd, k_bshd, v_bshd, causal, anti, scale, softcap=None):
        res = self._fa._flash_attn_forward(q_bshd, k_bshd, v_bshd, 0.0, scale, causal, -1, 0 if anti else -1,
                                           0.0 if softcap is None else float(softcap), None, False)
        return res[0], res[1]


def test_comparison_catches_a_wrong_window():
    q, k, v, _ = _inputs(5, 16, 16, 2)
    kern = _MirroredWindowKernel.__new__(_MirroredWindowKernel)
    kern._fa = stand_in
    out, _ = kern.forward_block(q, k, v, False, True, SCALE)
    ref_out, _ = MathKernel().forward_block(q, k, v, False, True, SCALE)
    with pytest.raises(AssertionError):
        _close("out", out, ref_out, **TIGHT)


def test_flash_kernel_refuses_what_flash_attn_refuses():
    """The kernel passes no dtype or head_dim it cannot take straight to flash-attn."""
    q, k, v, _ = _inputs(6, 8, 8, 2)
    with pytest.raises(FlashAttnContractError, match="fp16 and bf16"):
        _flash_kernel().forward_block(q.float(), k.float(), v.float(), False, False, SCALE)


# ---------------------------------------------------------------------------------------------
# contracts flash-attn enforces that the kernel must meet: a dense lse slice, head dims padded to 8


def test_backward_block_with_a_sliced_lse_as_ring_loop_passes_it():
    q, k, v, dout = _inputs(8, 24, 24, 2)
    out, lse = MathKernel().forward(q, k, v, False, SCALE)
    lse = lse.float()
    rows, keys = slice(8, 16), slice(8, 16)                 # a band sub-block: rows 8..15, keys 8..15
    args = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows])
    assert not args[-1].is_contiguous()
    got = _flash_kernel().backward_block(*args, True, False, SCALE)
    want = MathKernel().backward_block(*args, True, False, SCALE)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(name, g, w, **TIGHT)


def test_head_dim_not_a_multiple_of_8():
    q, k, v, dout = _inputs(9, 8, 8, 2, d=12)
    out, lse = _flash_kernel().forward_block(q, k, v, False, False, SCALE)
    ref_out, _ = MathKernel().forward_block(q, k, v, False, False, SCALE)
    _close("out", out, ref_out, **TIGHT)
